"""HSDP (--replicas R): ZeRO within each of R replica groups, the reduced shards all-reduced
across them, trains like plain single-process PyTorch (float32).

Exact here: the data each step sees and the initial weights. Equal to float32 rounding
(tests/equivalence.py's measured Tolerance): the gradient is summed in another order
(a reduce-scatter over the replica group, then an all-reduce across the groups), and the
global norm is a float64 sum of the shards' squares over one replica group only (the
other groups hold the same shards: counting them too would report sqrt(R) times the
norm, which the per-step norm comparison catches). Skipping the cross-replica all-reduce
leaves each group with its own half of the batch's gradient, which the losses, norms and
parameters all catch.

Every run goes through `paratrain.train.loop.train` (what `paratrain train` runs) under
NCCL's ordering rules (tests/distributed.py), several layouts per set of processes.
"""

from __future__ import annotations

import pytest

from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import check_layouts, tiny_config, tiny_data

CLIP = 0.5  # below the observed norms (about 1 to 3): clipping by the global norm is active


def hsdp_config(world, zero, replicas=2, micro_batch=2, dp=0, pp=1, tp=1, experts=0, **parallel):
    cfg = tiny_config(micro_batch=micro_batch, grad_clip=CLIP)
    cfg.model.num_experts = experts
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp, p.zero, p.replicas = world, dp, pp, tp, zero, replicas
    for key, value in parallel.items():
        setattr(p, key, value)
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


@pytest.mark.equivalence
def test_hsdp_zero_stages_match_single_process():
    """dp 4 = 2 replica groups x 2 shards: ZeRO-1, 2 (both accumulations) and 3, with one
    micro-batch per step and with two."""
    configs = [
        hsdp_config(4, zero, micro_batch=micro, bucket_mb=0.01)
        for zero in (1, 2, 3)
        for micro in (2, 1)  # K = 1, then K = 2 (G 8 over dp 4)
    ]
    configs.append(hsdp_config(4, 2, micro_batch=1, zero2_accumulate="full"))
    check_layouts(4, configs, CLIP)


def test_hsdp_composes_with_tensor_and_pipeline_parallelism():
    """dp 2 = 2 replica groups of one rank (shards of the whole) beside tp 2 or pp 2;
    dp 4 = 4 replica groups (every rank its own group: all-reduce only); and dp 2 x cp 2,
    where a replica group is one dp rank's 2 cp ranks (ZeRO shards over dp_cp)."""
    configs = [
        hsdp_config(4, 3, dp=2, tp=2, micro_batch=2),
        hsdp_config(4, 1, dp=2, pp=2, micro_batch=1),
        hsdp_config(4, 2, replicas=4, micro_batch=1),
        hsdp_config(4, 3, dp=2, cp=2, micro_batch=2),
        hsdp_config(4, 1, dp=2, cp=2, micro_batch=1),
    ]
    check_layouts(4, configs, CLIP)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"replicas": 3}, r"--replicas 3 does not divide the 4 data-parallel ranks; valid: 1, 2"),
        ({"zero": 0}, r"--replicas 2 needs ZeRO \(--zero 1, 2 or 3\)"),
        ({"ep": 4, "experts": 4}, r"--ep 4 does not divide a replica group's 2 ranks .*: 1, 2"),
    ],
)
def test_hsdp_refusals_name_the_flag_and_what_is_valid(change, message):
    settings = {"zero": 1, "replicas": 2, **change}
    with pytest.raises(ValueError, match=message):
        hsdp_config(4, **settings)


def _compare_each(rank, world, configs, data):
    from tests.test_prediction import train_and_compare

    return [train_and_compare(rank, world, cfg, data) for cfg in configs]


def test_hsdp_bytes_per_group_and_model_state_are_predicted_exactly():
    """The ledger's bytes per group and the runtime's model state equal the planner's on
    every rank (train/prediction.py, as `paratrain train` checks at the end), dp 4 = 2
    replica groups x 2: ZeRO over the 2 ranks of a replica group ("dp_shard"), and the
    gradient shard of 42,880 / 2 fp32 elements all-reduced over the 2 replica groups
    ("dp_replicate"): a ring all-reduce of two ranks sends each one half the buffer twice,
    21,440 x 4 bytes in all. The same with dp 2 x cp 2, a replica group being one dp
    rank's two cp ranks."""
    from tests.test_prediction import config

    configs = [config(dp=4, zero=zero, replicas=2) for zero in (1, 2, 3)]
    with_cp = tiny_config(steps=2, global_batch=8)
    p = with_cp.parallel
    p.nproc, p.dp, p.cp, p.zero, p.replicas = 4, 2, 2, 3, 2
    with_cp.train.microbatches = 0
    configs.append(resolve_and_check(with_cp, 4))
    per_rank = run_distributed(_compare_each, 4, configs, tiny_data())
    for rank, rank_results in enumerate(per_rank):
        for cfg, compared in zip(configs, rank_results, strict=True):
            predicted, measured = compared["predicted"], compared["measured"]
            assert predicted["model_state_bytes"] == measured["model_state_bytes"]
            assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]
            sent = measured["bytes_sent_per_step"][rank]
            assert sent["dp_replicate"] == 21_440 * 4, cfg.parallel.zero
            tokens_group = "dp" if cfg.parallel.cp == 1 else "dp_cp"  # (loss, tokens)
            assert sent["dp_shard"] > 0 and sent[tokens_group] > 0
            shard = measured["model_state_bytes"][rank]["optimizer"]
            assert shard == 2 * 4 * 21_440  # Adam's moments of a half, not a quarter


def test_planner_formulas_shard_over_a_replica_group_and_all_reduce_across():
    """`paratrain plan`'s formulas (plan/memory.py, plan/comm.py) for dp 8 = 2 replica
    groups of 4, ZeRO-3, mixed-precision Adam: 16N / 4 bytes per GPU (not 16N / 8), ZeRO-3's
    3 (k - 1) S / k per micro-batch with k = 4, and one all-reduce of the 2N / 4 bytes of
    gradient shard over the 2 groups: 2 (R - 1) / R of it."""
    from paratrain.plan.cluster import ClusterSpec
    from paratrain.plan.comm import dp_traffic
    from paratrain.plan.layout import Layout, Workload
    from paratrain.plan.memory import model_state_bytes
    from paratrain.plan.model import ModelSpec

    n, workload = 8_000_000, Workload(micro_batch=1, global_batch=8)
    hsdp = Layout(dp=8, zero=3, replicas=2)
    assert model_state_bytes(n, workload, hsdp).step_boundary == 16 * n // 4
    cluster = ClusterSpec("two nodes of 4", 8, 4, 80e9, 1e11, 1e10, 0, 0, 1e15, 0.5)
    entries = {
        (e.axis, e.what): e.bytes
        for e in dp_traffic(ModelSpec("m", n_params=n), workload, hsdp, cluster, 1)
    }
    assert entries[("dp_replicate", "gradient shards across replica groups")] == 2 * n // 4
    assert entries[("dp_shard", "gradients, every micro-batch")] == 3 * 2 * n // 4
    assert sum(b for (axis, _), b in entries.items() if axis == "dp_shard") == 3 * 3 * 2 * n // 4


def test_planner_formulas_for_experts_under_hsdp():
    """Mixtral 8x7B at dp 16 = 2 replica groups of 8, ep 4, ZeRO-1: the dense parameters
    shard over the group's 8 ranks, the experts (1/4 of them per rank) over the group's 2
    ranks holding the same ones; each set's gradient shard is all-reduced once over the 2
    groups, 2 (R - 1) / R of its bytes; the model state (mixed-precision Adam, ZeRO-1:
    4 bytes whole, 12 sharded) is the dense (4 + 12 / 8) N plus the experts'
    (4 + 12 / 2) E / 4."""
    from paratrain.plan import moe
    from paratrain.plan.cluster import ClusterSpec
    from paratrain.plan.comm import ACROSS_REPLICAS, dp_traffic
    from paratrain.plan.estimate import model_state
    from paratrain.plan.layout import Layout, Workload
    from paratrain.plan.model import model_preset

    m, workload = model_preset("mixtral-8x7b"), Workload(micro_batch=1, global_batch=16)
    experts = moe.all_expert_params(m)
    dense = m.params - experts
    layout = Layout(dp=16, zero=1, ep=4, replicas=2)
    cluster = ClusterSpec("two nodes of 8", 16, 8, 80e9, 1e11, 1e10, 0, 0, 1e15, 0.5)
    entries = {(e.axis, e.what): e.bytes for e in dp_traffic(m, workload, layout, cluster, 1)}
    grad = workload.precision.grad_bytes
    assert entries[("dp_replicate", ACROSS_REPLICAS)] == grad * -(-dense // 8)
    assert entries[("dp_replicate", "expert " + ACROSS_REPLICAS)] == grad * (experts // 4 // 2)
    assert {axis for axis, _ in entries} == {"dp_shard", "expert_shard", "dp_replicate"}
    state = model_state(m, workload, layout)
    expected = (4 + 12 / 8) * dense + (4 + 12 / 2) * experts / 4
    assert state.step_boundary == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="ep 16 does not divide a replica group's 8 ranks"):
        Layout(dp=16, zero=1, ep=16, replicas=2)


def _checkpointed_run(rank, world_size, dp, zero, replicas, run_dir, resume_step, rewarmup):
    from pathlib import Path

    from paratrain import checkpoint as ck
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    cfg = tiny_config(steps=6, checkpoint_every=3, rewarmup_steps=rewarmup)
    p = cfg.parallel
    p.dp, p.zero, p.replicas = dp, zero, replicas
    cfg.train.microbatches = cfg.train.global_batch // (cfg.train.micro_batch * dp)
    mesh = Mesh.build(dp=dp, replicas=replicas)
    resume = None
    if resume_step:
        resume = ck.Checkpoint(ck.checkpoint_path(Path(run_dir), resume_step), resume_step)
    result = train(cfg, mesh, tiny_data(), run_dir=Path(run_dir), resume=resume)
    return [m.loss for m in result.metrics]


def test_hsdp_checkpoints_resume_exactly_and_on_other_layouts(tmp_path):
    """A replica group's ranks hold the same shards: the checkpoint stores each box once
    (checkpoint/planner.py deduplicates identical boxes) as pieces of global tensors, so
    it resumes bitwise on the same layout and, within float32 rounding, with plain ZeRO-1
    on 2 ranks or with 4 replica groups of one rank (ZeRO-2)."""
    import shutil

    saved = tmp_path / "saved"
    full = run_distributed(_checkpointed_run, 4, 4, 3, 2, str(saved), 0, 0)[0]
    tail = full[3:]

    def resume(world, dp, zero, replicas, rewarmup=0):
        run = tmp_path / f"resume-dp{dp}-z{zero}-r{replicas}"
        shutil.copytree(saved, run)
        args = (dp, zero, replicas, str(run), 3, rewarmup)
        return run_distributed(_checkpointed_run, world, *args)[0]

    assert resume(4, 4, 3, 2) == tail  # bitwise: the same layout
    for world, dp, zero, replicas in [(2, 2, 1, 1), (4, 4, 2, 4)]:
        resumed = resume(world, dp, zero, replicas)
        assert max(abs(a - b) for a, b in zip(resumed, tail, strict=True)) < 1e-5, (dp, zero)
