"""`paratrain plan --compress`: the cluster estimates price the gradients' bytes and the
error buffers as the per-rank counts do (which tests/test_compression_training.py holds
to the runtime), and pass over the layouts that `paratrain train` refuses."""

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
