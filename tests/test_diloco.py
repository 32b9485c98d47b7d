"""--dp-mode diloco: replica groups that train apart and meet every H steps in an outer
step, equal to the same algorithm written here in plain PyTorch in one process.

The reference below shares no training code with paratrain: one plain model and one
`torch.optim.AdamW` per group, each group stepping on its own rows of every global batch
(the mean over its tokens, its own gradient norm clipped), and `torch.optim.SGD` (momentum,
Nesterov) as the outer optimizer over the global parameters, fed the groups' mean
pseudo-gradient, global minus local; every H steps and after the last, each group then
takes the global parameters. Tolerances are measured against the same reference in
float64, as tests/equivalence.py measures them (Tolerance).
"""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.config import RunConfig
from paratrain.data.document_rows import training_rows
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokens import TokenData
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import (
    SPREAD_ORDERS,
    RunRecord,
    Tolerance,
    assert_equivalent,
    reference_lr,
    run_and_record,
    tiny_config,
    tiny_data,
    train_layouts,
)


def fragment(name: str, blocks: int, fragments: int) -> int:
    """Streaming DiLoCo's fragment of a parameter of the (untied) test GPT: runs of
    consecutive blocks; the embeddings with the first, the final norm and head the last."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return int(parts[1]) * fragments // blocks
    return fragments - 1 if parts[0] in ("norm", "head") else 0


def diloco_training(
    cfg: RunConfig, data: TokenData, dtype: torch.dtype, accumulate: int
) -> tuple[list[RunRecord], dict]:
    """cfg's DiLoCo run in one process: a record per replica group (its losses and norms,
    and the final global parameters) and the initial state."""
    from paratrain.models.registry import plain_model  # the model only: no training code

    t, p = cfg.train, cfg.parallel
    torch.manual_seed(t.seed)
    with torch.device("cpu"):
        model = plain_model(cfg.model)
    initial = copy.deepcopy(model.state_dict())
    model.to(dtype=dtype)
    groups = [copy.deepcopy(model) for _ in range(p.replicas)]
    inner = []
    for m in groups:
        decay = [q for q in m.parameters() if q.dim() >= 2]
        rest = [q for q in m.parameters() if q.dim() < 2]
        spec = [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": rest, "weight_decay": 0},
        ]
        if t.optimizer == "sgd":  # plain SGD, the decay as torch's L2 term
            inner.append(torch.optim.SGD(spec, lr=t.lr))
        else:
            inner.append(torch.optim.AdamW(spec, lr=t.lr, betas=(t.beta1, t.beta2)))
    names = [n for n, _ in model.named_parameters()]
    global_ = [q.detach().clone().requires_grad_() for q in model.parameters()]
    pending: list[tuple[int, set[int], list]] = []  # (lands after, fragments, mean grads)
    mu = p.outer_momentum
    outer = torch.optim.SGD(
        global_, lr=p.outer_lr, momentum=mu, nesterov=p.outer_nesterov and mu > 0
    )
    sampler = training_rows(data, run_row_layout(cfg, False), t.seq_len, t.global_batch, t.seed)
    losses = [[] for _ in groups]
    norms = [[] for _ in groups]
    for step in range(t.steps):
        rows = sampler.global_batch_at(step).chunk(p.replicas)
        for g, (m, opt) in enumerate(zip(groups, inner, strict=True)):
            for group in opt.param_groups:
                group["lr"] = reference_lr(step, cfg)
            opt.zero_grad()
            total = 0.0
            for part in rows[g].chunk(accumulate):
                loss = m(part[:, :-1], part[:, 1:]) / accumulate
                loss.backward()
                total += loss.item()
            clip = t.grad_clip or float("inf")
            norms[g].append(torch.nn.utils.clip_grad_norm_(m.parameters(), clip).item())
            opt.step()
            for module in m.modules():  # a mixture of experts' balancing bias: its own
                if hasattr(module, "balance_bias"):  # per-step update, after the step
                    module.balance_bias()
            losses[g].append(total)
        outer_steps(step + 1, cfg, names, groups, global_, outer, pending)
    state = {k: v.detach().clone() for k, v in groups[0].state_dict().items()}
    return [RunRecord(losses[g], norms[g], state) for g in range(p.replicas)], initial


def outer_steps(done, cfg, names, groups, global_, outer, pending) -> None:
    """After `done` inner steps: the outer steps landing (merged by alpha), then those due
    start (landing tau steps later); after the last step every one in flight lands, the
    rest take one at once, and every group takes the global parameters."""
    p, last = cfg.parallel, done == cfg.train.steps
    offsets = [f * p.sync_every // p.fragments for f in range(p.fragments)]
    due = {f for f in range(p.fragments) if done % p.sync_every == offsets[f]}
    landed: set[int] = set()
    for item in [x for x in pending if x[0] == done or last]:
        pending.remove(item)
        _apply(item[1], item[2], cfg, names, groups, global_, outer, p.merge_alpha)
        landed |= item[1]
    due = set(range(p.fragments)) - landed if last else due
    if due:
        grads = _mean_pseudo_gradients(due, cfg, names, groups, global_)
        if p.sync_delay and not last:
            pending.append((done + p.sync_delay, due, grads))
        else:
            _apply(due, grads, cfg, names, groups, global_, outer, 0.0 if last else p.merge_alpha)
    if last:
        _apply(set(), [None] * len(names), cfg, names, groups, global_, outer, 0.0)


def _mean_pseudo_gradients(fragments, cfg, names, groups, global_) -> list:
    """Per parameter, the groups' mean of global minus local if in `fragments`, else None."""
    out = []
    with torch.no_grad():
        for i, (name, q) in enumerate(zip(names, global_, strict=True)):
            mine = fragment(name, cfg.model.n_layer, cfg.parallel.fragments) in fragments
            local = [list(m.parameters())[i] for m in groups]
            out.append(torch.stack([q - x for x in local]).mean(0) if mine else None)
    return out


def _apply(fragments, grads, cfg, names, groups, global_, outer, merge) -> None:
    """The outer SGD on the parameters given a gradient (those of `fragments`), then every
    group's copies of `fragments` (all of them when none is given: the run's end) set to
    merge x local + (1 - merge) x global."""
    with torch.no_grad():
        for q, g in zip(global_, grads, strict=True):
            q.grad = g
        if any(g is not None for g in grads):
            outer.step()
        for m in groups:
            for name, local, q in zip(names, m.parameters(), global_, strict=True):
                f = fragment(name, cfg.model.n_layer, cfg.parallel.fragments)
                if fragments and f not in fragments:
                    continue
                local.copy_(local * merge + q * (1 - merge) if merge else q)


def diloco_reference(cfg: RunConfig, data: TokenData) -> tuple[list[RunRecord], dict]:
    """Per group, the float32 record with the tolerance measured against float64 over
    SPREAD_ORDERS accumulation orders (those that divide a group's rows; for a mixture of
    experts only the whole batch, since capacity is per micro-batch)."""
    rows = cfg.train.global_batch // cfg.parallel.replicas
    orders = [k for k in SPREAD_ORDERS if rows % k == 0 and not cfg.model.num_experts]
    orders = orders or [1]
    runs = [diloco_training(cfg, data, torch.float32, k) for k in orders]
    exact, _ = diloco_training(cfg, data, torch.float64, 1)
    records, initial = runs[0]
    for g, record in enumerate(records):
        record.tolerance = Tolerance.measured(exact[g], [r[g] for r, _ in runs])
    return records, initial


def diloco_config(world: int, sync_every: int, lr: float, momentum: float, nesterov: bool,
                  **parallel: int) -> RunConfig:  # fmt: skip
    cfg = tiny_config(steps=5, global_batch=8)
    p = cfg.parallel
    p.nproc, p.dp_mode, p.replicas, p.sync_every = world, "diloco", 2, sync_every
    p.outer_lr, p.outer_momentum, p.outer_nesterov = lr, momentum, nesterov
    for key, value in parallel.items():
        setattr(p, key, value)
    cfg.train.microbatches = 0
    streaming = p.fragments > 1 or p.sync_delay or p.merge_alpha
    cfg.train.checkpoint_every = 0 if streaming else cfg.train.checkpoint_every
    return resolve_and_check(cfg, world)


CASES = {  # name: (world, H, outer lr, momentum, nesterov, layout)
    "dp 2, groups of 1, Nesterov": (2, 2, 0.7, 0.9, True, dict(dp=2)),
    # Streaming: H 4, fragments after steps 2 (the second) and 4 (the first), all after 5
    "streaming, 2 fragments, dp 2": (2, 4, 0.7, 0.9, True, dict(dp=2, fragments=2)),
    "streaming, 2 fragments, dp 4 ZeRO-1": (4, 4, 0.7, 0.9, True, dict(dp=4, zero=1, fragments=2)),
    "streaming, 2 fragments, dp 2 x pp 2": (4, 4, 0.5, 0.5, False, dict(dp=2, pp=2, fragments=2)),
    # overlap: a fragment's step lands a step after it starts (the first one's at the end)
    "streaming, tau 1, alpha 0.5, dp 2": (
        2,
        4,
        0.7,
        0.9,
        True,
        dict(dp=2, fragments=2, sync_delay=1, merge_alpha=0.5),
    ),
    "tau 1, alpha 0, dp 4 ZeRO-1": (4, 2, 0.7, 0.9, True, dict(dp=4, zero=1, sync_delay=1)),
    # more fragments than H: p 2 over H 1, both at offset 0, every step
    "streaming, 2 fragments over H 1, dp 2": (2, 1, 0.7, 0.9, True, dict(dp=2, fragments=2)),
    # tau 3 beyond H / p = 2: one fragment's step still in flight when the other's starts
    "streaming, 2 fragments, tau 3, dp 2": (
        2,
        4,
        0.7,
        0.9,
        True,
        dict(dp=2, fragments=2, sync_delay=3),
    ),  # fmt: skip
    "alpha 0.5, dp 2 x tp 2": (4, 2, 0.7, 0.9, True, dict(dp=2, tp=2, merge_alpha=0.5)),
    "dp 4, ZeRO-1 groups of 2, averaging": (4, 3, 1.0, 0.0, False, dict(dp=4, zero=1)),
    "dp 2 x pp 2, ZeRO-1, momentum": (4, 2, 0.5, 0.5, False, dict(dp=2, pp=2, zero=1)),
    "dp 2 x tp 2, ZeRO-3": (4, 2, 0.7, 0.9, True, dict(dp=2, tp=2, zero=3)),
    "dp 4, ZeRO-2 over our ring": (4, 2, 0.7, 0.9, True, dict(dp=4, zero=2, comm_algo="ring")),
    "dp 2 x pp 2, gpipe": (4, 2, 0.7, 0.9, True, dict(dp=2, pp=2, schedule="gpipe")),
    "dp 2 x cp 2, ring attention": (4, 2, 0.7, 0.9, True, dict(dp=2, cp=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_diloco_equals_the_algorithm_in_one_process(name):
    """Every rank's losses and gradient norms are its group's, and the final parameters
    (after the last outer step, one model) the reference's global ones, each within the
    tolerance measured against float64. Steps 5 with H 2 or 3: outer steps inside the
    run and one more after the last step. With outer lr 1 and no momentum the outer step
    is parameter averaging."""
    world, sync_every, lr, momentum, nesterov, layout = CASES[name]
    cfg = diloco_config(world, sync_every, lr, momentum, nesterov, **layout)
    p = cfg.parallel
    data = tiny_data()
    records = run_distributed(train_layouts, world, [(p.dp, p.pp, p.tp, cfg)], data)
    references, initial = diloco_reference(cfg, data)
    from paratrain.mesh import MeshShape

    shape = MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, replicas=p.replicas)
    state = {}
    for [record] in records:
        state.update(record.state)
    for rank, [record] in enumerate(records):
        group = shape.coords(rank)["dp"] // (p.dp // p.replicas)
        reference = references[group]
        assert_equivalent(RunRecord(record.losses, record.grad_norms, state), reference, initial)
    assert references[0].losses != references[1].losses  # the groups did train apart


def _replicate_traffic(rank: int, world: int, cfg: RunConfig, data: TokenData) -> tuple:
    """This rank's ledger bytes over dp_replicate by step, and the model's parameters."""
    from paratrain.comm.ledger import Ledger
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    ledger, p = Ledger(max_recent=100_000), cfg.parallel
    mesh = Mesh.build(dp=p.dp, replicas=p.replicas, ledger=ledger)
    result = train(cfg, mesh, data)
    mesh.close()
    sent: dict[int, int] = {}
    for r in ledger.recent():
        if r.group == "dp_replicate":
            sent[r.step] = sent.get(r.step, 0) + r.bytes_sent
    return sent, sum(q.numel() for q in result.model.parameters())


def test_the_groups_meet_only_in_the_outer_steps_sending_their_pieces_once():
    """dp 4 as 2 groups of 2 under ZeRO-1, H 2, 5 steps: across the groups (dp_replicate)
    nothing is sent on inner steps; on steps 2, 4 and 5 each rank sends its float32 shard
    of the pseudo-gradient once, in a ring all-reduce over the 2 groups (half of it)."""
    from paratrain.plan.comm import ring_all_reduce_rank_bytes
    from paratrain.plan.muon_shards import unpadded_elements

    cfg = diloco_config(4, 2, 0.7, 0.9, True, dp=4, zero=1)
    for rank, (sent, params) in enumerate(run_distributed(_replicate_traffic, 4, cfg, tiny_data())):
        group, shard = divmod(rank, 2)
        piece = unpadded_elements([params], 2, shard)
        outer = ring_all_reduce_rank_bytes(piece, 4, 2, group)
        assert sent == {2: outer, 4: outer, 5: outer}


class _Counting:
    """An OuterStep that records which pieces each outer step took."""

    def __init__(self) -> None:
        self.steps = 0
        self.synced: list[list[int] | None] = []

    def start(self, which: list[int] | None = None) -> list[int] | None:
        return which

    def finish(self, started: list[int] | None, merge: float = 0.0, rebuild: bool = True):
        self.steps += 1
        self.synced.append(started)

    def step(self, which: list[int] | None = None, merge: float = 0.0, rebuild: bool = True):
        self.finish(which)

    def take_global(self) -> None: ...

    def after(self) -> None: ...


def test_outer_steps_and_checkpoints_fall_where_the_groups_hold_one_model():
    """H 3, 14 steps, --checkpoint-every 4: outer steps after 3, 6, 9, 12 and the last;
    checkpoints at the first outer step at or after each multiple of 4 (6, 9, 12) and at
    the last; a stop's sync after an outer step's adds none."""
    from paratrain.train.diloco import OuterSteps

    cfg = diloco_config(2, 3, 0.7, 0.9, True, dp=2)
    cfg.train.steps, cfg.train.checkpoint_every = 14, 4
    counting = _Counting()
    outer = OuterSteps(cfg, counting, [[0]])  # type: ignore[arg-type]
    synced, saved = [], []
    for done in range(1, 15):
        before = counting.steps
        outer.after_step(done)
        if done == 6:  # a stop right after an outer step
            outer.sync(done)
        synced += [done] * (counting.steps - before)
        saved += [done] if outer.checkpoint_due(done) else []
    assert synced == [3, 6, 9, 12, 14]
    assert saved == [6, 9, 12, 14]
    outer.sync(7)  # a stop between outer steps takes one
    assert counting.steps == 6


def test_a_checkpoint_resumes_bitwise_and_on_another_inner_layout(tmp_path):
    """dp 4 as 2 ZeRO-1 groups of 2, H 2, 6 steps, --checkpoint-every 3: checkpoints after
    the outer steps of steps 4 (the first at or after 3) and 6. Resumed from step 4 on the
    same layout, steps 5 and 6 and the final parameters are bitwise the uninterrupted run's
    (each group's AdamW moments are its own: saving group 0's for both fails this);
    resumed on dp 2 x tp 2 without ZeRO (groups of one rank, tp-split), they equal the
    one-process reference within its float64-measured tolerance."""
    import shutil

    from paratrain import checkpoint as ck

    cfg = diloco_config(4, 2, 0.7, 0.9, True, dp=4, zero=1)
    cfg.train.steps, cfg.train.checkpoint_every = 6, 3
    saved = tmp_path / "saved"
    full = run_distributed(run_and_record, 4, cfg, str(saved), 0)
    assert [c.step for c in ck.complete_checkpoints(saved)] == [4, 6]
    again = tmp_path / "again"
    shutil.copytree(saved, again)
    resumed_run = run_distributed(run_and_record, 4, cfg, str(again), 4)
    for whole, resumed in zip(full, resumed_run, strict=True):
        assert resumed.losses == whole.losses[4:] and resumed.grad_norms == whole.grad_norms[4:]
        assert all(torch.equal(resumed.state[k], v) for k, v in whole.state.items())
    other = diloco_config(4, 2, 0.7, 0.9, True, dp=2, tp=2)
    other.train.steps, other.train.checkpoint_every = 6, 3
    moved = tmp_path / "moved"
    shutil.copytree(saved, moved)
    records = run_distributed(run_and_record, 4, other, str(moved), 4)
    references, initial = diloco_reference(cfg, tiny_data())
    state = {k: v for r in records for k, v in r.state.items()}
    for rank, record in enumerate(records):
        reference = references[rank // 2]  # dp 2 x tp 2: ranks 0, 1 are group 0
        tail = RunRecord(reference.losses[4:], reference.grad_norms[4:], reference.state)
        tail.tolerance = reference.tolerance
        assert_equivalent(RunRecord(record.losses, record.grad_norms, state), tail, initial)


def _tracked(rank: int, world: int, configs: list[RunConfig]) -> list[dict]:
    from tests.test_prediction import train_and_compare

    return [train_and_compare(rank, world, cfg, tiny_data()) for cfg in configs]


def test_the_summary_measures_the_outer_copies_and_the_bytes_of_the_whole_run():
    """dp 4 as 2 ZeRO-1 groups of 2 (H 2, 5 steps: outer steps 2, 4, 5) beside the same
    layout as synchronous HSDP: the measured model state differs by the outer step's two
    float32 copies of the rank's shard (global parameters as master, momentum as optimizer
    state); the last step (an outer one) sent one ring all-reduce of the shard across the
    groups and `bytes_sent_total` three; nothing crosses the groups otherwise."""
    from paratrain.models.registry import plain_model
    from paratrain.plan.comm import ring_all_reduce_rank_bytes
    from paratrain.plan.muon_shards import unpadded_elements

    diloco = diloco_config(4, 2, 0.7, 0.9, True, dp=4, zero=1)
    hsdp = tiny_config(steps=5, global_batch=8)
    hsdp.parallel.nproc, hsdp.parallel.dp, hsdp.parallel.zero, hsdp.parallel.replicas = 4, 4, 1, 2
    hsdp.train.microbatches = 0
    hsdp = resolve_and_check(hsdp, 4)
    params = sum(q.numel() for q in plain_model(diloco.model).parameters())
    for rank, (ours, sync) in enumerate(run_distributed(_tracked, 4, [diloco, hsdp])):
        group, shard = divmod(rank, 2)
        piece = unpadded_elements([params], 2, shard)
        outer = ring_all_reduce_rank_bytes(piece, 4, 2, group)
        state, theirs = (r["measured"]["model_state_bytes"][rank] for r in (ours, sync))
        extra = {k: state[k] - theirs[k] for k in ("params", "grads", "optimizer", "master")}
        assert extra == {"params": 0, "grads": 0, "optimizer": 4 * piece, "master": 4 * piece}
        last, total = (
            ours["measured"][k][rank] for k in ("bytes_sent_per_step", "bytes_sent_total")
        )
        assert last["dp_replicate"] == outer and total["dp_replicate"] == 3 * outer
        assert last["dp"] == total["dp"] == last["dp_cp"] == total["dp_cp"] == 0, (last, total)


PREDICTED = {  # name: (H, outer momentum, layout): each rank's state and bytes predicted
    "dp 2, groups of 1": (2, 0.9, dict(dp=2)),
    "dp 4, ZeRO-1 groups of 2": (2, 0.9, dict(dp=4, zero=1)),
    "dp 4, ZeRO-3, no momentum": (3, 0.0, dict(dp=4, zero=3)),
    "dp 4 in bfloat16 (one flat buffer)": (2, 0.9, dict(dp=4, dtype="bfloat16")),
    "dp 2 x pp 2, ZeRO-2": (2, 0.9, dict(dp=2, pp=2, zero=2)),
    "dp 2 x tp 2": (2, 0.9, dict(dp=2, tp=2)),
    "streaming, 2 fragments, ZeRO-1": (4, 0.9, dict(dp=4, zero=1, fragments=2)),
    "int8 outer gradients, ZeRO-1": (2, 0.9, dict(dp=4, zero=1, outer_dtype="int8")),
    "fp4 outer gradients, groups of 1": (2, 0.9, dict(dp=2, outer_dtype="fp4")),
    "bfloat16 outer gradients, dp 2 x tp 2": (2, 0.9, dict(dp=2, tp=2, outer_dtype="bfloat16")),
    "dp 2 x cp 2, ZeRO-1": (2, 0.9, dict(dp=2, cp=2, zero=1)),
}


def test_the_planner_predicts_every_rank_of_a_diloco_run_exactly():
    """Model state (the group's wrappers', the outer copy as master and the momentum as
    optimizer state) and bytes by group of the last step (an outer one: the group's own
    traffic over dp_shard, the outer all-reduce over dp_replicate) predicted = measured on
    every rank (plan/rank_diloco.py). Leaving out the outer copy, or predicting the
    group's traffic over dp, fails it."""
    by_world: dict[int, list[RunConfig]] = {}
    for sync_every, momentum, layout in PREDICTED.values():
        layout = dict(layout)
        dtype = layout.pop("dtype", "float32")
        world = layout["dp"] * layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
        cfg = diloco_config(world, sync_every, 0.7, momentum, momentum > 0, **layout)
        cfg.train.dtype = dtype
        by_world.setdefault(world, []).append(resolve_and_check(cfg, world))
    for world, configs in by_world.items():
        for compared in run_distributed(_tracked, world, configs):
            for c in compared:
                predicted, measured = c["predicted"], c["measured"]
                assert predicted["model_state_bytes"] == measured["model_state_bytes"]
                assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]


def test_each_fragment_synchronizes_once_per_h_steps_at_its_offset():
    """Streaming DiLoCo, p 3 fragments, H 6, 20 steps: fragment f after steps t with
    t mod 6 = 2 f, each once per 6 steps; after the last step, the fragments not yet
    synchronized there; a stop's sync after that adds none. Blocks 0-1, 2-3, 4-5 of 6
    form the fragments; the embeddings go with the first, the final norm and head with the
    last, a tied head with the first."""
    from paratrain.models.plans import GPT_PLAN
    from paratrain.train.diloco import OuterSteps, fragment_of

    cfg = tiny_config(steps=20)  # the schedule alone: no model is built
    cfg.parallel.sync_every, cfg.parallel.fragments, cfg.train.checkpoint_every = 6, 3, 0
    counting = _Counting()
    outer = OuterSteps(cfg, counting, [[0], [1], [2]])  # type: ignore[arg-type]
    for done in range(1, 21):
        outer.after_step(done)
    outer.sync(20)
    expected = {2: [1], 4: [2], 6: [0], 8: [1], 10: [2], 12: [0], 14: [1], 16: [2], 18: [0],
                20: [0, 1, 2]}  # fmt: skip
    assert counting.synced == list(expected.values())
    names = {"tok_emb.weight": 0, "pos_emb.weight": 0, "blocks.1.attn.q.weight": 0,
             "blocks.2.ln1.weight": 1, "blocks.5.mlp.fc.bias": 2, "norm.weight": 2,
             "head.weight": 2}  # fmt: skip
    for name, f in names.items():
        assert fragment_of(name, GPT_PLAN, 6, 3, tied=False) == f, name
    assert fragment_of("head.weight", GPT_PLAN, 6, 3, tied=True) == 0


def test_quantized_outer_gradients_leave_every_group_on_the_same_model(tmp_path):
    """dp 2 in groups of one, fp4 outer gradients: the groups end bitwise equal (each
    decodes the same bytes of the mean), on parameters that differ from the float32 run's
    (the codec was used)."""
    runs = {}
    for dtype in ("float32", "fp4"):
        cfg = diloco_config(2, 2, 0.7, 0.9, True, dp=2, outer_dtype=dtype)
        runs[dtype] = run_distributed(run_and_record, 2, cfg, str(tmp_path / dtype), 0)
    group0, group1 = runs["fp4"]
    assert all(torch.equal(group0.state[k], group1.state[k]) for k in group0.state)
    plain = runs["float32"][0]
    assert any(not torch.equal(group0.state[k], plain.state[k]) for k in plain.state)


def test_h1_with_sgd_inside_and_out_is_data_parallel_sgd():
    """DiLoCo with H 1, inner plain SGD, outer SGD at lr 1 without momentum: averaging the
    groups' SGD steps is one SGD step on the averaged gradient (SGD is linear; both groups
    hold as many tokens; no clipping, which is per group here and global there). In
    float64 the reference of 2 groups equals the one of a single group (data parallelism)
    to 1e-12 of the largest parameter, float64 reassociation; then the DiLoCo run (dp 4,
    ZeRO-1 groups of 2) and synchronous data parallelism with SGD (dp 4, ZeRO-1) both lie
    within the float64-measured tolerance of that reference."""
    diloco = diloco_config(4, 1, 1.0, 0.0, False, dp=4, zero=1)
    sync = tiny_config(steps=5, global_batch=8)
    for cfg in (diloco, sync):
        cfg.train.optimizer, cfg.train.grad_clip = "sgd", 0.0
    sync.parallel.nproc, sync.parallel.dp, sync.parallel.zero = 4, 4, 1
    sync.train.microbatches = 0
    diloco, sync = resolve_and_check(diloco, 4), resolve_and_check(sync, 4)
    data = tiny_data()
    one_group = copy.deepcopy(diloco)
    one_group.parallel.replicas = 1
    two, _ = diloco_training(diloco, data, torch.float64, 1)
    one, _ = diloco_training(one_group, data, torch.float64, 1)
    top = max(v.abs().max().item() for v in one[0].state.values())
    for k, v in one[0].state.items():
        assert (two[0].state[k].double() - v.double()).abs().max().item() <= 1e-12 * top
    references, initial = diloco_reference(diloco, data)
    tol = references[0].tolerance
    runs = [(c.parallel.dp, 1, 1, c) for c in (diloco, sync)]
    for rank, (ours, theirs) in enumerate(run_distributed(train_layouts, 4, runs, data)):
        reference = references[rank // 2]
        assert_equivalent(ours, reference, initial)
        for k, v in reference.state.items():
            assert (theirs.state[k] - v).abs().max().item() <= tol.param_atol, k


@pytest.mark.parametrize("ep", [1, 2])
def test_a_mixture_of_experts_routes_within_its_group(ep):
    """moe-tiny (capacity 1.25, balancing loss) at dp 4 as 2 groups of 2, ZeRO-1: each
    group's routers see the group's batch alone (each rank's one micro-batch, gathered over
    the group), its experts whole (ep 1) or split over the group's 2 ranks (ep 2), and the
    outer step moves the experts with the rest; equal to the reference, whose groups route
    over their own rows, within its float64-measured tolerance."""
    from tests.test_moe_training import layout_config

    cfg = layout_config(4, 1, ep, 1, "native")
    p = cfg.parallel
    p.dp_mode, p.replicas, p.sync_every, p.outer_lr, p.outer_momentum = "diloco", 2, 2, 0.7, 0.9
    cfg.train.steps, cfg.train.val_batches = 5, 0
    cfg = resolve_and_check(cfg, 4)
    data = tiny_data()
    records = run_distributed(train_layouts, 4, [(4, 1, 1, cfg)], data)
    references, initial = diloco_reference(cfg, data)
    state = {k: v for [r] in records for k, v in r.state.items()}
    for rank, [record] in enumerate(records):
        reference = references[rank // 2]
        assert_equivalent(RunRecord(record.losses, record.grad_norms, state), reference, initial)


def test_the_planner_predicts_diloco_with_experts_per_rank():
    """moe-tiny at dp 4 as 2 groups of 2 with ep 2, ZeRO-1 and ZeRO-3: each rank's model
    state (both shares' wrappers and outer copies) and bytes by group (the experts' over
    expert_shard, routing within the group) predicted = measured, but for the routed
    tokens of the expert all-to-all (test_prediction.py's one term)."""
    from tests.test_moe_training import layout_config
    from tests.test_muon import _compare_but_routed
    from tests.test_prediction import train_each

    configs = []
    for zero in (1, 3):
        cfg = layout_config(4, 1, 2, zero, "native")
        p = cfg.parallel
        p.dp_mode, p.replicas, p.sync_every = "diloco", 2, 2
        cfg.train.steps, cfg.train.val_batches = 4, 0
        configs.append(resolve_and_check(cfg, 4))
    for rank, results in enumerate(run_distributed(train_each, 4, configs, tiny_data())):
        _compare_but_routed(rank, results)
