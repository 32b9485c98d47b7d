"""`paratrain plan --compress` and `--dp-mode diloco`: the cluster estimates price the
gradients' bytes and error buffers, and DiLoCo's groups and outer steps, as the per-rank
counts do (which tests/test_compression_training.py and test_diloco.py hold to the
runtime), and pass over the layouts that `paratrain train` refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.config import RunConfig
from paratrain.plan.estimate import estimate
from paratrain.plan.rank_compress import compress_state_bytes
from paratrain.plan.rank_groups import Coords
from paratrain.plan.rank_memory import rank_model_state
from paratrain.plan.rank_traffic import ONE_NODE, rank_traffic
from paratrain.plan.run_inputs import planner_inputs
from paratrain.validate import resolve_and_check
from tests.equivalence import tiny_config
from tests.test_cli_main import refused


def _inputs(world: int, method: str, zero: int) -> tuple:
    cfg: RunConfig = tiny_config()
    cfg.train.global_batch, cfg.train.micro_batch = 24, 2  # 3 and 4 ranks divide it
    p = cfg.parallel
    p.nproc, p.dp, p.zero, p.compress, p.compress_rank = world, world, zero, method, 2
    model, workload, layout, _ = planner_inputs(resolve_and_check(cfg, world))
    return model, workload, layout, replace(ONE_NODE, gpus=world, gpus_per_node=world)


@pytest.mark.parametrize(
    ("method", "zero"), [("int8", 0), ("sign", 1), ("int8", 2), ("powersgd", 0), ("powersgd", 2)]
)
def test_the_estimate_prices_a_gpu_as_the_per_rank_counts_price_rank_zero(method, zero):
    """On 3 GPUs without tp or pp, where the estimates' one buffer of N / (tp pp) is the
    runtime's: the estimate's gradient bytes equal rank 0's exact count, its gradients'
    memory (with the error buffers, and the factors) too, and --compress none prices
    more bytes than any method."""
    model, workload, layout, cluster = _inputs(3, method, zero)
    est = estimate(model, cluster, workload, layout)
    assert not est.problems
    k = est.microbatches
    at = Coords()
    exact = [t for t in rank_traffic(model, workload, layout, k, at) if "gradients" in t.what]
    priced = [e for e in est.comm if e.what.startswith("gradients")]
    assert sum(e.bytes for e in priced) == sum(t.bytes for t in exact)
    assert all(e.what.endswith(f"({method})") for e in priced)
    held = rank_model_state(model, workload, layout).grads
    assert est.model_state.grads == held + compress_state_bytes(model, workload, layout, at)
    plain = estimate(model, cluster, replace(workload, compress="none"), layout)
    plain_bytes = sum(e.bytes for e in plain.comm if e.what.startswith("gradients"))
    assert sum(e.bytes for e in priced) < plain_bytes


def test_a_search_passes_over_the_layouts_train_refuses():
    """--compress with ZeRO-3, and PowerSGD across HSDP's groups, are problems of the
    layout (the search's table leaves them out), as `paratrain train` refuses them."""
    model, workload, layout, cluster = _inputs(4, "int8", 1)
    assert estimate(model, cluster, workload, replace(layout, zero=3)).problems
    hsdp = replace(layout, replicas=2)
    assert not estimate(model, cluster, workload, hsdp).problems
    powersgd = replace(workload, compress="powersgd")
    assert estimate(model, cluster, powersgd, hsdp).problems


@pytest.mark.parametrize(
    "flags",
    [
        ["--params", "7e9", "--compress", "powersgd"],
        ["--preset", "7b", "--compress", "int8", "--lora-rank", "4"],
        ["--preset", "7b", "--compress", "powersgd", "--compress-rank", "0"],
    ],
)
def test_what_the_estimates_cannot_price_is_refused_in_one_line(flags, capsys):
    assert "--compress" in refused(capsys, "plan", *flags)


@pytest.mark.parametrize(("zero", "dtype"), [(1, "float32"), (0, "int8")])
def test_diloco_is_priced_as_a_group_run_with_the_outer_step_spread_over_h(zero, dtype):
    """dp 4 in 2 groups, H 4: the estimate's step is the group run's (dp 2, its reductions
    over dp_shard) plus a quarter of the outer step, whose bytes are rank 0's exact count
    (plan/rank_diloco.py, held to the runtime in tests/test_diloco.py); under ZeRO-1 the
    parameters' all-gather again, a quarter of it; the state gains the global copy and the
    momentum of the GPU's pieces, 4 bytes each, as master and optimizer state."""
    from paratrain.plan.rank_diloco import group_layout, outer_bytes, outer_elements

    model, workload, layout, cluster = _inputs(4, "none", zero)
    diloco = replace(workload, sync_every=4, outer_dtype=dtype)
    hsdp = replace(layout, replicas=2)
    est = estimate(model, cluster, diloco, hsdp)
    group = estimate(model, replace(cluster, gpus=2), workload, group_layout(hsdp))
    assert not est.problems and not group.problems
    pieces = outer_elements(model, workload, group_layout(hsdp), Coords())
    [outer] = [e for e in est.comm if e.axis == "dp_replicate"]
    assert outer.bytes == outer_bytes(pieces, dtype, 2, 0) // 4
    inner = {e.what: e.bytes for e in est.comm if e.axis == "dp_shard"}
    assert {w: b for w, b in inner.items() if "again" not in w} == {
        e.what: e.bytes for e in group.comm if e.axis == "dp"
    }
    if zero:
        gather = inner["updated parameters"]
        assert inner["updated parameters, again after the outer step"] == gather // 4
    state, plain = est.model_state, group.model_state
    assert state.optimizer - plain.optimizer == state.master - plain.master == 4 * pieces


def test_diloco_without_groups_is_a_problem_and_its_flags_alone_are_refused(capsys):
    model, workload, layout, cluster = _inputs(4, "none", 1)
    assert estimate(model, cluster, replace(workload, sync_every=4), layout).problems
    assert "--dp-mode diloco" in refused(capsys, "plan", "--preset", "7b", "--sync-every", "5")
    assert "--replicas" in refused(capsys, "plan", "--preset", "7b", "--dp-mode", "diloco")
