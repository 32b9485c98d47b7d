"""ZeRO-3 / FSDP on its own: units, prefetch order in the ledger, the gathered memory the
allocator holds against prefetch depth, a user's model with a root unit and an unused
parameter, and checkpoints (sharded pieces and the full state dict)."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from paratrain.measure.allocator import AllocatorMeter
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.fsdp_units import GATHER_SCOPE, expand_units
from paratrain.train.build import build_model, run_gpt_config
from tests.distributed import run_distributed
from tests.equivalence import RunRecord, Tolerance, tiny_config


def gpt_units(model: nn.Module) -> list[list[str]]:
    return expand_units(model, GPT_PLAN.fsdp_units)


def test_gpt_units_are_embeddings_each_block_and_the_head():
    model = build_model(tiny_config())
    assert gpt_units(model) == [
        ["tok_emb", "pos_emb"],
        ["blocks.0"],
        ["blocks.1"],
        ["norm", "head"],
    ]
    model.tok_emb = model.pos_emb = None  # a later pipeline stage: no embeddings
    assert expand_units(model, [("tok_emb", "pos_emb"), ("blocks.*",)]) == [
        ["blocks.0"],
        ["blocks.1"],
    ]


def one_step(rank, world_size, depths):
    """Forward and backward of one micro-batch per prefetch depth, under the allocator
    meter: events, ledger, the gathered parameters the allocator held (peak, and at the
    end), and the wrapper's own counter."""
    mesh = Mesh.build(dp=world_size)
    out = {}
    for depth in depths:
        cfg = tiny_config()
        model = FullyShardedDataParallel(
            build_model(cfg), mesh.group("dp"), gpt_units(build_model(cfg)), prefetch=depth
        )
        model.zero_grad()
        batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
        with AllocatorMeter() as meter:
            model(batch[:, :-1], batch[:, 1:]).backward()
            model.finish_gradient_sync()
        starts = {r.seq: (r.op, r.start) for r in mesh.ledger.recent()}
        gathered = (meter.peak(scope=GATHER_SCOPE), meter.held(scope=GATHER_SCOPE))
        out[depth] = (list(model.events), starts, gathered, model.peak_gathered_bytes)
    return out


@functools.cache
def prefetch_runs() -> list[dict]:
    """One 2-rank run of `one_step` at depths 0-3, shared by the two tests below."""
    return run_distributed(one_step, 2, [0, 1, 2, 3])


def test_prefetch_issues_the_next_gather_before_the_current_unit_ends():
    """Depth 1: unit l+1's gather is in the ledger before unit l's forward ends; depth 0:
    after it."""
    for by_depth in prefetch_runs():
        for depth, (events, starts, _, _) in by_depth.items():
            ends = {e[1]: e[2] for e in events if e[0] == "forward_end"}
            gathers = [e for e in events if e[0] == "gather" and e[2] == "forward"]
            if depth == 0:
                assert not gathers  # gathered only on demand, never ahead
                continue
            assert {g[1] for g in gathers} == set(range(1, 4))
            for _, unit, _, seq in gathers:
                op, start = starts[seq]  # the ledger's own record of that call
                assert op == "all_gather"
                assert start < ends[unit - 1], (depth, unit)
                if unit - depth - 1 >= 0:  # not issued before the unit depth+1 back ended
                    assert start > ends[unit - depth - 1]
            backward = [e[1] for e in events if e[0] == "gather" and e[2] == "backward"]
            assert backward == sorted(backward, reverse=True) and backward


def window_bytes(sizes: list[int], depth: int) -> int:
    """The most bytes of depth + 1 consecutive units: what prefetch depth d holds at once
    (the unit computing and the d gathered ahead of it, forward or backward)."""
    return max(sum(sizes[i : i + depth + 1]) for i in range(len(sizes)))


def test_gathered_memory_the_allocator_holds_grows_one_unit_per_prefetch_depth():
    """The allocator's peak of gathered parameters during a forward and backward (the
    profiler's allocation events inside the unit-storage range, `GATHER_SCOPE`) against
    `window_bytes`, with unit sizes from the plain model's parameters (fp32, k divides
    every unit): depth 0 holds one unit at a time (a block, 50,816 B), depth 1 two blocks,
    depth 2 two blocks and the embeddings, depth 3 the whole model (4N). Within 10%;
    measured equal to the byte. Nothing gathered is left once the backward is done. The
    wrapper's own `peak_gathered_bytes` is checked against the allocator, not the other
    way round."""
    plain = build_model(tiny_config())
    units = [[plain.get_submodule(n) for n in names] for names in gpt_units(plain)]
    sizes = [4 * sum(p.numel() for m in unit for p in m.parameters()) for unit in units]
    for by_depth in prefetch_runs():
        peaks = []
        for depth, (_, _, (peak, held), counter) in by_depth.items():
            formula = window_bytes(sizes, depth)
            assert abs(peak - formula) <= 0.1 * formula, (depth, peak, formula, sizes)
            assert held == 0, (depth, held)
            assert counter == peak, (depth, counter, peak)
            peaks.append(peak)
        assert peaks == sorted(set(peaks)), peaks  # every extra unit of depth costs memory


class Net(nn.Module):
    """Not our GPT: two units, a root parameter outside them, and an unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))  # in no unit: the root
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.unused = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x * self.scale), y, reduction="sum")


def user_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def user_loop(rank, world_size):
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        Net(), Mesh.build(dp=world_size).group("dp"), [["body.0"], ["body.2"], ["unused"]]
    )
    opt = model.build_optimizer(0.05, 0.0, (0.9, 0.95))
    shard = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for step in range(4):
        model.zero_grad()
        x, y = user_data(step)
        model(x[shard], y[shard]).backward()
        model.finish_gradient_sync()
        model.scale_grads_(1 / 8)
        opt.step()
    pieces = {
        piece.name: (piece.shape, piece.lo, piece.hi, piece.tensors["model"].clone())
        for piece in model.checkpoint_pieces(opt)[0]
    }
    return model.full_state_dict(), pieces, [u.name for u in model.units]


def one_process(dtype: torch.dtype) -> RunRecord:
    torch.manual_seed(0)
    ref = Net().to(dtype)  # drawn in float32, as the wrapped Net
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(4):
        opt.zero_grad()
        x, y = user_data(step)
        (ref(x.to(dtype), y) / 8).backward()
        opt.step()
    return RunRecord([], [], {k: v.detach().clone() for k, v in ref.state_dict().items()})


def test_user_model_with_a_root_unit_and_an_unused_parameter_matches_one_process():
    """Within tests/equivalence.py's Tolerance of one process: the sharded step adds the
    ranks' gradients in another order; derived from one process in float32 vs float64."""
    reference = one_process(torch.float32)
    atol = Tolerance.measured(one_process(torch.float64), [reference]).param_atol
    results = run_distributed(user_loop, 2)
    for full, _, names in results:
        assert names == ["<root>", "body.0", "body.2", "unused"]
        for name, value in reference.state.items():
            assert (full[name] - value).abs().max().item() <= atol, name
    # The ranks' sharded pieces put together again are the full parameters, exactly (both
    # are copies of the same shards): a sharded checkpoint holds everything needed to
    # reshard to any k.
    full = results[0][0]
    for name, value in reference.state.items():
        flat = torch.zeros(value.numel())
        for _, pieces, _ in results:
            if name in pieces:
                shape, lo, hi, values = pieces[name]
                assert shape == value.shape
                flat[lo:hi] = values
        assert torch.equal(flat.view_as(value), full[name]), name


def checkpoint(rank, world_size):
    cfg = tiny_config()
    model = FullyShardedDataParallel(
        build_model(cfg), Mesh.build(dp=world_size).group("dp"), gpt_units(build_model(cfg))
    )
    return model.full_state_dict()


def test_full_state_dict_loads_into_a_single_process_model():
    cfg = tiny_config()
    expected = build_model(cfg).state_dict()
    state = run_distributed(checkpoint, 2)[1]
    plain = GPT(run_gpt_config(cfg))
    plain.load_state_dict(copy.deepcopy(state))
    for name, value in expected.items():
        assert torch.equal(plain.state_dict()[name], value), name
