"""--optimizer muon at world 4: what tests/test_muon.py shows at world 2 and in a few
world-4 layouts, for the rest of the strategies (issue 35's exactness tests).

1. Bitwise against torch under ZeRO-1 and ZeRO-3 at 4 ranks. At two ranks a reduced
   gradient is one sum of two, the same in any order, so ZeRO's shards hold bitwise the
   all-reduce's values and a whole training run can be compared (test_muon.py
   `test_sharded_muon_at_two_ranks_is_bitwise_whole_muon`). At four, a reduce-scatter
   adds the four gradients in another order than an all-reduce, so the optimizer is fed
   the averaged gradient directly: every rank puts its slice of one known gradient into
   its shards, and after 5 steps the parameters must equal, bitwise, torch.optim.Muon
   (bfloat16 Newton-Schulz) plus torch.optim.AdamW fed that gradient in one process.
   Exact because the step runs torch's operations on the same values (muon_math.py):
   only the whole matrix's orthogonalization is order-sensitive, and its pieces meet at
   one owner unchanged (float32 there, the result's bfloat16 bits back).
2. Every other world-4 layout at accumulation 1 and 4, trained by the loop the workers
   run: losses and Muon's matrices within 1e-5 relative of one process, float32
   Newton-Schulz (the layouts add the same gradients in other orders; bfloat16 would turn
   a last-bit difference into a rounding of 2^-8, muon_math.py), and the Newton-Schulz
   calls over the ranks exactly the matrices' shapes times the steps, whatever the
   accumulation. All layouts train in turn in one launch of 4 processes, the references in
   one launch of one.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from paratrain.comm import CommOptions
from paratrain.mesh import Mesh
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.data_parallel import muon_math
from paratrain.parallel.data_parallel.adamw import param_groups
from paratrain.parallel.data_parallel.muon import muon_matrix_names
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data

LR, DECAY, BETAS = 2e-2, 0.1, (0.9, 0.95)
WORLD, STEPS = 4, 5


def muon_matrix_names_of(cfg) -> list[str]:
    """Muon's matrices of cfg's plain model, by the plan (GPT's, for moe-tiny too)."""
    from paratrain.models.registry import plain_model

    return muon_matrix_names(plain_model(cfg.model), GPT_PLAN.muon_matrices)


def wide_shapes(shapes) -> Counter:
    """How many matrices of each shape, in the wide orientation Newton-Schulz runs on."""
    return Counter(tuple(sorted(s)) for s in shapes)


def _count_newton_schulz(calls: list[tuple[int, ...]]):
    """This rank's Newton-Schulz calls, counted from outside the optimizer (as test_muon.py's
    `_train_counting`): each call's matrix shape is appended to `calls`. Returns the
    original function, to put back."""
    wide = muon_math.orthogonalize_wide

    def counted(update, *args):
        calls.append(tuple(update.shape))
        return wide(update, *args)

    muon_math.orthogonalize_wide = counted
    return wide


def _straddling(wrapper, names: set[str]) -> list[str]:
    """The Muon matrices that a boundary between two ranks' shards cuts in two."""
    cut = []
    for shard in wrapper.shards:
        layout = shard.layout
        bounds = [layout.shard_range(r)[0] for r in range(1, layout.k)]
        cut += [
            s.name
            for s in layout.segments
            if s.name in names and any(s.start < b < s.end for b in bounds)
        ]
    return cut


def _fed_steps_on_rank(rank, world_size, runs):
    """For each (config, nesterov) of `runs`: the plain model wrapped as training wraps it
    (train/build.py `data_parallel`), its shards' gradients set to this rank's slice of
    each step's averaged gradient, which a plain copy computes on the same batch in every
    rank; beside it torch.optim.Muon and AdamW step that copy with the whole gradient."""
    from paratrain.models.registry import plain_model
    from paratrain.train.build import data_parallel

    mesh = Mesh.build(dp=world_size, options=CommOptions())
    out = []
    for cfg, nesterov in runs:
        torch.manual_seed(cfg.train.seed)
        model = plain_model(cfg.model)
        reference = copy.deepcopy(model)  # before the wrapper makes the weights flat views
        wrapper = data_parallel(model, mesh.group("dp"), cfg, GPT_PLAN)
        names = muon_matrix_names(reference, GPT_PLAN.muon_matrices)
        settings = MuonSettings(GPT_PLAN.muon_matrices, nesterov=nesterov)
        assert settings.ns_dtype == torch.bfloat16  # torch.optim.Muon's
        calls: list[tuple[int, ...]] = []
        wide = _count_newton_schulz(calls)
        opt = wrapper.build_optimizer(LR, DECAY, BETAS, muon=settings)
        named = dict(reference.named_parameters())
        ref_muon = torch.optim.Muon([named[n] for n in names], lr=LR, weight_decay=DECAY,
                                    nesterov=nesterov, adjust_lr_fn="match_rms_adamw")  # fmt: skip
        others = [n for n in named if n not in names]
        ref_adamw = torch.optim.AdamW(param_groups(reference, DECAY, others), lr=LR, betas=BETAS)
        for step in range(STEPS):
            for group in [*opt.param_groups, *ref_muon.param_groups, *ref_adamw.param_groups]:
                group["lr"] = LR / (step + 1)  # a schedule reaches Muon's group as AdamW's
            x = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
            reference.zero_grad()
            reference(x[:, :-1], x[:, 1:]).backward()  # the step's gradient, on every rank
            wrapper.zero_grad()
            for shard in wrapper.shards:  # this rank's slice of it, where training puts it
                pieces = shard.layout.local_pieces(shard.rank)
                for piece, view in zip(pieces, shard.piece_views(shard.grad), strict=True):
                    whole = named[piece.segment.name].grad.reshape(-1)
                    view.copy_(whole[piece.lo : piece.hi])
            opt.step()
            ref_muon.step()
            ref_adamw.step()
        muon_math.orthogonalize_wide = wide
        ours = wrapper.full_state_dict()  # collective: the shards put together
        theirs = {n: p.detach().clone() for n, p in named.items()}
        initial = plain_model(cfg.model) if torch.manual_seed(cfg.train.seed) else None
        moved = max((theirs[n] - p).abs().max().item() for n, p in initial.named_parameters())
        out.append((ours, theirs, calls, _straddling(wrapper, set(names)), moved))
    mesh.close()
    return out


def test_sharded_muon_at_four_ranks_is_bitwise_torch_muon_fed_the_same_gradients():
    """ZeRO-1 (one flat buffer over 4 ranks) and ZeRO-3 (the plan's FSDP units, each its
    own buffer over 4 ranks), Nesterov on and off, 5 steps at a changing lr, bfloat16
    Newton-Schulz: every parameter bitwise torch.optim.Muon's or AdamW's, on every rank.
    Matrices straddle the shard boundaries (so pieces travel to their owners and back),
    and each matrix is orthogonalized once per step: the calls over the 4 ranks are the
    matrices' shapes times the steps, and every rank makes some of them."""
    runs = []
    for zero in (1, 3):
        cfg = tiny_config()
        t, p = cfg.train, cfg.parallel
        t.optimizer, t.dtype, p.device, p.nproc, p.zero = "muon", "float32", "cpu", WORLD, zero
        cfg = resolve_and_check(cfg, WORLD)  # the run's own configuration: dp 4
        runs += [(cfg, nesterov) for nesterov in (True, False)]
    per_rank = run_distributed(_fed_steps_on_rank, WORLD, runs)
    names = muon_matrix_names_of(runs[0][0])
    for i, (cfg, nesterov) in enumerate(runs):
        run = f"ZeRO-{cfg.parallel.zero}, nesterov {nesterov}"
        results = [r[i] for r in per_rank]
        for rank, (ours, theirs, _, straddle, moved) in enumerate(results):
            assert moved > 1e-3, (run, moved)  # the steps moved the weights: not vacuous
            assert straddle, f"{run}: no Muon matrix crosses a shard boundary at {WORLD}"
            for name, value in theirs.items():
                assert torch.equal(ours[name], value), (run, rank, name)
        shapes = wide_shapes(results[0][1][n].shape for n in names)
        calls = wide_shapes(c for r in results for c in r[2])
        assert calls == Counter({s: n * STEPS for s, n in shapes.items()}), run
        assert all(r[2] for r in results), run  # the work is spread over every rank


def _train_each(rank, world_size, runs, data):
    """Each (config, mesh degrees) of `runs` trained in turn by the workers' loop: this
    rank's losses, its whole Muon matrices (tp shards put together; a pipeline stage's
    own) and its Newton-Schulz calls, counted from outside the optimizer."""
    from paratrain.parallel.tensor_parallel import full_state_dict
    from paratrain.train.loop import train

    out = []
    for cfg, degrees in runs:
        names = set(muon_matrix_names_of(cfg))
        calls: list[tuple[int, ...]] = []
        wide = _count_newton_schulz(calls)
        mesh = Mesh.build(**degrees, options=CommOptions())
        try:
            result = train(cfg, mesh, data)
        finally:
            muon_math.orthogonalize_wide = wide
        chunks = result.model if isinstance(result.model, list) else [result.model]
        state = {}
        for chunk in chunks:
            whole = full_state_dict(chunk, mesh.group("tp"))
            state.update({k: v for k, v in whole.items() if k in names})
        mesh.close()
        out.append(([m.loss for m in result.metrics], state, calls))
    return out


def dense_config(accumulation: int, n_layer: int = 2, **parallel) -> tuple:
    """The tiny GPT with 4 heads (tp 4: one each), a global batch of 16 rows taken in
    `accumulation` micro-batches per replica, 3 steps, float32 Newton-Schulz; with the mesh
    degrees the layout trains on."""
    cfg = tiny_config()
    cfg.model.n_layer, cfg.model.n_head = n_layer, 4
    t, p = cfg.train, cfg.parallel
    t.optimizer, t.muon_ns_dtype, t.dtype, t.val_batches = "muon", "float32", "float32", 0
    t.steps = 3
    p.device, p.nproc = "cpu", WORLD if parallel else 1
    for key, value in parallel.items():
        setattr(p, key, value)
    t.global_batch = 16
    dp = p.nproc // (p.pp * p.tp * p.cp)
    t.micro_batch, t.microbatches, p.dp = t.global_batch // (dp * accumulation), 0, 0
    cfg = resolve_and_check(cfg, p.nproc)
    return cfg, dict(dp=cfg.parallel.dp, pp=p.pp, tp=p.tp, cp=p.cp)


def moe_config(accumulation: int, dp: int = WORLD, ep: int = 2) -> tuple:
    """moe-tiny (test_moe_training.py's) at dp x ep. One micro-batch per replica routes the
    reference's whole batch (capacity and the balancing loss over it); with 4 per replica
    the router sees one micro-batch of every replica at a time, not one process's (docs/
    experts.md), so there no assignment is dropped and no balancing loss is added: each
    token is then routed alone, whatever it is batched with."""
    from tests.test_moe_training import layout_config

    cfg = layout_config(dp, 1, ep, 0, "native")
    t, m = cfg.train, cfg.model
    t.optimizer, t.muon_ns_dtype, t.val_batches = "muon", "float32", 0
    if accumulation > 1:
        m.capacity_factor, m.aux_loss_coef = 0.0, 0.0
    t.global_batch, t.micro_batch, t.microbatches = 16, 16 // (dp * accumulation), 0
    cfg.parallel.dp = 0
    cfg = resolve_and_check(cfg, cfg.parallel.nproc)
    return cfg, dict(dp=dp, ep=ep)


# name -> dense_config's arguments (None: moe_config): the world-4 layouts that test_muon.py
# leaves out (it has dp 4, dp 2 x pp 2, dp 2 x tp 2, ZeRO-2 dp 4 and HSDP)
LAYOUTS = {
    "ZeRO-1 dp 4": dict(zero=1),
    "ZeRO-3 dp 4": dict(zero=3),
    "dp 2 x cp 2": dict(cp=2),
    "pp 4": dict(pp=4, n_layer=4),  # a block per stage
    "tp 4": dict(tp=4),
    "dp 2 x pp 2, ZeRO-1": dict(pp=2, zero=1),
    # ZeRO's pieces of tp shards: assembled over dp, then put together over tp
    "dp 2 x tp 2, ZeRO-1": dict(tp=2, zero=1),
    "dp 2 x tp 2, ZeRO-3": dict(tp=2, zero=3),
    "moe-tiny dp 4 x ep 2": None,
}
ACCUMULATIONS = (1, 4)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_muon_at_world_four_trains_as_one_process_at_accumulation_one_and_four():
    """Each layout at 1 and 4 micro-batches per replica and step, against one process
    (dense: the batch in 4 micro-batches; MoE: as its docstring says): every rank's losses
    within 1e-5 relative, every Muon matrix within 1e-5 relative on each rank holding it
    (each held somewhere), and over the 4 ranks each matrix orthogonalized once per step:
    the calls' shapes are the matrices' times the steps, at either accumulation."""
    runs, references = [], {}
    for name, layout in LAYOUTS.items():
        for k in ACCUMULATIONS:
            run = moe_config(k) if layout is None else dense_config(k, **layout)
            layers = (layout or {}).get("n_layer", 2)
            single = moe_config(k, dp=1, ep=1) if layout is None else dense_config(4, layers)
            assert run[0].train.microbatches == k and run[0].parallel.nproc == WORLD
            key = repr(single[0])  # one reference per distinct configuration
            references.setdefault(key, single)
            runs.append((name, k, run, key))
    keys = list(references)
    data = tiny_data()
    singles = run_distributed(_train_each, 1, [references[k] for k in keys], data)[0]
    single = dict(zip(keys, singles, strict=True))
    per_rank = run_distributed(_train_each, WORLD, [r[2] for r in runs], data, timeout=600)
    for i, (name, k, (cfg, _), key) in enumerate(runs):
        losses, state, _ = single[key]
        names = muon_matrix_names_of(cfg)
        assert set(state) == set(names) and len(losses) == cfg.train.steps
        compared = set()
        for rank, results in enumerate(per_rank):
            rank_losses, rank_state, _ = results[i]
            where = f"{name}, accumulation {k}, rank {rank}"
            assert rank_losses == pytest.approx(losses, rel=1e-5), where
            for matrix, value in rank_state.items():
                diff = _relative(value, state[matrix])
                assert diff <= 1e-5, (where, matrix, diff)
                compared.add(matrix)
        assert compared == set(names), (name, k)
        shapes = wide_shapes(state[n].shape for n in names)
        calls = wide_shapes(c for results in per_rank for c in results[i][2])
        expected = Counter({s: n * cfg.train.steps for s, n in shapes.items()})
        assert calls == expected, (name, k, calls, expected)
