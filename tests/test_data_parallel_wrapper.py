"""The DataParallel wrapper on its own: a user's model and loop, unused parameters, masked
tokens, one gradient sync per step, and all-reduces overlapped with the backward pass."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from paratrain import comm
from paratrain.comm.traffic import ring_all_reduce
from paratrain.mesh import Mesh
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.token_rows import IGNORE_INDEX
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step
from tests.distributed import run_distributed
from tests.equivalence import RunRecord, Tolerance, tiny_config


class TwoHeads(nn.Module):
    """Not our GPT: an MLP with a head that the loss never uses (no gradient, ever)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.unused_head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def user_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def user_loop(rank, world_size, steps):
    """The README's few lines: wrap, then an ordinary loop on this rank's shard."""
    torch.manual_seed(0)
    model = DataParallel(TwoHeads(), Mesh.build(dp=world_size).group("dp"), bucket_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x, y = user_data(step)
        shard = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        loss = nn.functional.cross_entropy(model(x[shard]), y[shard])
        loss.backward()
        model.finish_gradient_sync()
        opt.step()
        model.zero_grad()
    return copy.deepcopy(model.module.state_dict())


def one_process(dtype: torch.dtype) -> RunRecord:
    torch.manual_seed(0)
    ref = TwoHeads().to(dtype)  # drawn in float32, as the wrapped one
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        x, y = user_data(step)
        nn.functional.cross_entropy(ref(x.to(dtype)), y).backward()
        opt.step()
        opt.zero_grad()
    return RunRecord([], [], {k: v.detach().clone() for k, v in ref.state_dict().items()})


def test_user_model_with_an_unused_parameter_matches_one_process():
    """Within tests/equivalence.py's Tolerance, derived from one process in float32 vs
    float64: the replicas' averaged gradients are the batch's, summed in another order."""
    reference = one_process(torch.float32)
    atol = Tolerance.measured(one_process(torch.float64), [reference]).param_atol
    for state in run_distributed(user_loop, 2, 5):
        for name, value in reference.state.items():
            assert (state[name] - value).abs().max().item() <= atol, name


def masked_step(rank, world_size):
    """Replicas and micro-batches with different numbers of unmasked target tokens."""
    cfg = tiny_config()
    mesh = Mesh.build(dp=world_size)
    model = DataParallel(build_model(cfg), mesh.group("dp"), reduce_op="sum")
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1)  # Adam would amplify rounding
    batches = masked_batches()
    mine = batches[rank * 2 : rank * 2 + 2]  # two micro-batches per replica
    out = train_step(FlatEngine(model), opt, mine, lr=0.1, grad_clip=0.0)
    return out.loss, copy.deepcopy(model.module.state_dict())


def masked_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(4)]
    batches[0][:, 5:] = IGNORE_INDEX  # first micro-batch: mostly padding
    batches[3][0, 1:] = IGNORE_INDEX  # one row of another fully masked
    return batches


def masked_one_process(dtype: torch.dtype) -> RunRecord:
    model = build_model(tiny_config()).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    whole = torch.cat(masked_batches())
    loss = model(whole[:, :-1].clamp(min=0), whole[:, 1:])  # mean over unmasked tokens
    loss.backward()
    opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return RunRecord([loss.item()], [], state)


def test_masked_tokens_are_weighted_by_count_not_by_micro_batch():
    """Within the Tolerance of one process on the whole batch (float32 vs float64): the
    micro-batches' token-weighted sums are the whole batch's, added in another order."""
    reference = masked_one_process(torch.float32)
    tol = Tolerance.measured(masked_one_process(torch.float64), [reference])
    for rank_loss, state in run_distributed(masked_step, 2):
        assert math.isclose(rank_loss, reference.losses[0], rel_tol=tol.loss_rtol)
        for name, value in reference.state.items():
            assert (state[name] - value).abs().max().item() <= tol.param_atol, name


def sync_counts(rank, world_size, micro_batch, algo):
    cfg = tiny_config(micro_batch=micro_batch)
    mesh = Mesh.build(dp=world_size, options=comm.CommOptions(algo=algo))
    model = DataParallel(build_model(cfg), mesh.group("dp"), bucket_mb=0.01, reduce_op="sum")
    opt = adamw(model.module, 1e-3, 0.0, (0.9, 0.95))
    engine = FlatEngine(model)
    g = torch.Generator().manual_seed(rank)
    mesh.ledger.reset()
    steps = 3
    for _ in range(steps):
        per_replica = cfg.train.global_batch // world_size
        batch = torch.randint(0, 256, (per_replica, 17), generator=g)
        train_step(engine, opt, list(batch.split(micro_batch)), lr=1e-3, grad_clip=1.0)
    totals = mesh.ledger.totals()[("dp", "all_reduce")]
    bucket_bytes = [b.nbytes for b in model.buckets]
    return totals.calls, totals.bytes_sent, bucket_bytes, steps


def test_one_gradient_sync_per_step_whatever_k_and_algorithm():
    for micro_batch in (4, 2, 1):  # K = 1, 2, 4 micro-batches per replica
        for algo in ("native", "ring"):
            for rank, (calls, sent, buckets, steps) in enumerate(
                run_distributed(sync_counts, 2, micro_batch, algo)
            ):
                assert len(buckets) > 1
                chunks = lambda n: [n // 2 + (i < n % 2) for i in range(2)]  # noqa: E731
                per_step = sum(ring_all_reduce(chunks(b), rank).sent for b in buckets)
                per_step += ring_all_reduce(chunks(16), rank).sent  # (loss, tokens), float64
                assert calls == steps * (len(buckets) + 1), (micro_batch, algo)
                assert sent == steps * per_step, (micro_batch, algo)


def overlap(rank, world_size):
    cfg = tiny_config()
    mesh = Mesh.build(dp=world_size)
    model = DataParallel(build_model(cfg), mesh.group("dp"), bucket_mb=0.005)
    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(rank))
    model(batch[:, :-1], batch[:, 1:]).backward()
    import time

    backward_done = time.perf_counter()
    model.finish_gradient_sync()
    starts = [r.start for r in mesh.ledger.recent() if r.op == "all_reduce"]
    return len(model.buckets), starts, backward_done


def test_first_bucket_is_all_reduced_before_backward_ends():
    for buckets, starts, backward_done in run_distributed(overlap, 2):
        assert buckets > 2 and len(starts) == buckets
        assert starts[0] < backward_done  # issued from a hook, during backward
        assert sum(s < backward_done for s in starts) >= buckets - 1
