"""`paratrain bench dp` against DDP in miniature: 2 ranks, 2 pairs, a 2-layer GPT.

Both sides take the global gradient norm and neither clips by it (`norm_only`: clipping by
norms equal to the last bits, ours summed in float64, lets AdamW drift the two apart), so
the two runs do the same float32 arithmetic and must agree bit for bit: our loss (the
global batch's mean) equals the mean of DDP's per-rank losses at every step, and the final
parameters are equal. No timing is asserted.
"""

from __future__ import annotations

import pytest

from paratrain import cli
from paratrain.bench.dp.run import LOSS_RTOL, compare_ddp
from paratrain.bench.harness.pairs import check_mean_losses
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data


def test_ours_and_ddp_agree_bit_for_bit_norm_to_norm():
    cfg = tiny_config(global_batch=4)
    assert cfg.train.grad_clip == 1.0  # the bench turns it off for both sides
    result = compare_ddp(2, 25.0, cfg, tiny_data().train)
    assert result["pairs"] == 2
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"]
    assert result["max_loss_rel_diff"] == 0.0
    assert result["max_param_diff"] == 0.0
    assert "clip_grad_norm_(foreach=True) at 0.0" in result["peer"]


def test_our_global_loss_is_compared_with_the_mean_of_the_peers():
    # Rank 0 and 1 see different data: the peer's losses differ by rank, ours is global.
    assert check_mean_losses([[(4.0, 3.9)], [(4.0, 4.1)]], LOSS_RTOL) < 1e-12
    with pytest.raises(RuntimeError, match="losses differ at step 1"):
        check_mean_losses([[(5.0, 5.0), (3.0, 3.0)], [(5.0, 5.0), (3.0, 3.2)]], LOSS_RTOL)


def test_too_few_pairs_is_a_one_line_error(capsys):
    assert cli.main(["bench", "dp", "--pairs", "3"]) == 2
    assert "at least 4 pairs" in capsys.readouterr().err


def ddp_and_our_buckets(rank: int, world: int, bucket_mb: float) -> tuple[list[int], list[int]]:
    """Bytes per bucket, first launched first: DDP's (given ddp_buckets) after it rebuilt
    them in its second step, and ours for the same parameters."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.bench.harness.ddp_pairs import ddp_buckets
    from paratrain.config import RunConfig
    from paratrain.parallel.data_parallel.buckets import build_buckets
    from paratrain.train.build import build_model

    module = build_model(RunConfig())  # the bench's model: 3.6 MB of gradients
    ours = [b.nbytes for b in build_buckets(list(module.parameters()), int(bucket_mb * 2**20))]
    ddp = DistributedDataParallel(module, gradient_as_bucket_view=True, **ddp_buckets(bucket_mb))
    tokens = torch.randint(0, 256, (1, 17))
    for _ in range(2):
        ddp(tokens[:, :-1], tokens[:, 1:]).backward()
    sizes = ddp._get_ddp_logging_data()["bucket_sizes"]  # last launched first
    return ours, [int(s) for s in reversed(sizes.split(", "))]


@pytest.mark.parametrize("bucket_mb", [25.0, 1.5, 0.0])
def test_the_peer_buckets_the_gradients_as_ours_does(bucket_mb):
    """The same caps: a first bucket of at most 1 MiB, then bucket_mb. DDP closes a bucket
    at the parameter that crosses its cap, ours before it, so a bucket may differ by the
    parameter at its edge (at most 262,144 bytes here: an MLP matrix), never in number."""
    ours, ddp = run_distributed(ddp_and_our_buckets, 2, bucket_mb, order="gloo")[0]
    assert len(ddp) == len(ours), (ddp, ours)
    assert all(abs(a - b) <= 128 * 512 * 4 for a, b in zip(ddp, ours, strict=True)), (ddp, ours)
