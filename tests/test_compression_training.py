"""--compress through the wrappers and the training loop: where compression changes
nothing the run equals one process; ZeRO-2 gets its slice of the data-parallel mean; the
planner predicts every byte and error buffer; a checkpoint resumes bitwise."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from paratrain.config import RunConfig
from paratrain.models.presets import preset
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import check_layouts, run_and_record, tiny_config, tiny_data


def compress_config(
    world: int, method: str, zero: int = 0, dtype: str = "float32", **parallel: object
) -> RunConfig:
    cfg = tiny_config(grad_clip=0.5, dtype=dtype)
    if world % 2:  # a batch that 3 ranks divide, in K = 2 micro-batches
        cfg.train.global_batch, cfg.train.micro_batch = 12, 2
    p = cfg.parallel
    p.nproc, p.dp, p.zero, p.compress = world, world, zero, method
    for key, value in parallel.items():
        setattr(p, key, value)
    return resolve_and_check(cfg, world)


def test_where_compression_changes_nothing_the_run_equals_one_process():
    """PowerSGD at a rank no smaller than any matrix's side averages every matrix exactly
    (the tiny GPT's are 32 wide: rank 32), with DP and with ZeRO-2; int8 before
    --compress-start is the exact reduction. Each equals one process within the float64-
    measured tolerances; the same runs at rank 31 (every matrix approximated) do not."""
    configs = [
        compress_config(2, "powersgd", 0, compress_rank=32),
        compress_config(2, "powersgd", 2, compress_rank=32),
        compress_config(2, "int8", 1, compress_start=100),
    ]
    check_layouts(2, configs, 0.5)
    with pytest.raises(AssertionError):
        check_layouts(2, [compress_config(2, "powersgd", 0, compress_rank=31)], 0.5)


def _gradients(rank: int, world: int, method: str) -> dict:
    """One backward of the tiny GPT on this rank's rows, reduced by DataParallel and by
    ZeRO-1 and ZeRO-2 with `method`: the whole mean (as ZeRO's flat order) and the shards."""
    from paratrain.mesh import Mesh
    from paratrain.models.registry import plain_model
    from paratrain.parallel.data_parallel import DataParallel
    from paratrain.parallel.data_parallel.compression import CompressSettings
    from paratrain.parallel.data_parallel.zero import ZeroDataParallel

    cfg = tiny_config()
    mesh = Mesh.build(dp=world)
    group = mesh.group("dp")
    settings = CompressSettings(method, rank=2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g)
    out = {}
    for name, wrap in [
        ("dp", lambda m: DataParallel(m, group, reduce_op="avg", compress=settings)),
        ("zero1", lambda m: ZeroDataParallel(m, group, 1, reduce_op="avg", compress=settings)),
        ("zero2", lambda m: ZeroDataParallel(m, group, 2, reduce_op="avg", compress=settings)),
    ]:
        torch.manual_seed(0)
        replica = wrap(plain_model(cfg.model))
        logits = replica(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        replica.finish_gradient_sync()
        if name == "dp":  # in ZeRO's flat order: the parameters reversed
            grads = [p.grad.reshape(-1) for p in reversed(list(replica.module.parameters()))]
            out[name] = torch.cat(grads)
        else:
            out[name] = replica.shard.grad.clone()
            out["shard"] = replica.layout.shard_range(group.rank)
    mesh.close()
    return out


@pytest.mark.parametrize("method", ["powersgd", "int8", "sign"])
def test_zero_gets_its_slice_of_the_compressed_data_parallel_mean(method):
    """On 2 ranks: ZeRO-1's and ZeRO-2's reduced shards are bitwise the same (one
    compressed reduce-scatter). PowerSGD's approximation is whole on every rank, so each
    shard is bitwise the slice of DataParallel's mean. A codec's all-reduce encodes the
    owners' means once more to gather them, which ZeRO does not need: its shard is within
    that rounding of DataParallel's (int8: half a step of the block's largest value)."""
    results = run_distributed(_gradients, 2, method)
    for res in results:
        assert torch.equal(res["zero1"], res["zero2"])
        lo, hi = res["shard"]
        whole = res["dp"]
        mine = res["zero2"][: max(0, min(hi, whole.numel()) - lo)]
        piece = whole[lo : lo + mine.numel()]
        if method == "powersgd":
            assert torch.equal(mine, piece)
        elif method == "int8":
            assert (mine - piece).abs().max() <= whole.abs().max() / 127  # two half steps
    assert torch.equal(results[0]["dp"], results[1]["dp"])


@pytest.mark.parametrize(
    ("world", "method", "zero", "replicas"),
    [(2, "int8", 2, 1), (2, "powersgd", 0, 1), (4, "sign", 1, 2)],
    ids=["zero2-int8", "dp-powersgd", "hsdp-sign"],
)
def test_a_checkpoint_resumes_bitwise_with_the_error_buffers(
    tmp_path, world, method, zero, replicas
):
    """6 steps saved at 3: resumed from step 3, steps 4 to 6 and the final parameters are
    bitwise the uninterrupted run's, since each rank's errors (and PowerSGD's factors) are
    saved under its own keys and loaded back (watched: dropping them at the load fails every
    case)."""
    cfg = compress_config(world, method, zero, replicas=replicas, compress_rank=2)
    cfg.train.steps, cfg.train.checkpoint_every = 6, 3
    saved = tmp_path / "saved"
    full = run_distributed(run_and_record, world, cfg, str(saved), 0)
    again = tmp_path / "again"
    shutil.copytree(saved, again)
    resumed = run_distributed(run_and_record, world, cfg, str(again), 3)
    for whole, part in zip(full, resumed, strict=True):
        assert part.losses == whole.losses[3:] and part.grad_norms == whole.grad_norms[3:]
        assert all(torch.equal(part.state[k], v) for k, v in whole.state.items())


def _tracked(rank: int, world: int, configs: list[RunConfig]) -> list[dict]:
    from tests.test_prediction import train_and_compare

    return [train_and_compare(rank, world, cfg, tiny_data()) for cfg in configs]


def test_the_planner_predicts_the_bytes_and_error_buffers_of_compressed_runs():
    """On 3 ranks (chunks that 3 does not divide: uneven owners), every rank's model state
    (the error buffers, and a codec all-reduce's second-rounding error, as gradients) and
    bytes per step by group are the planner's (plan/rank_compress.py), for int8 over DP,
    sign over ZeRO-2 reduce-scattering each of K = 2 micro-batches, int8 over ZeRO-1 in
    bfloat16 and over ZeRO-0 (mixed precision's flat buffer); each sends at least 3.9
    (int8) or 20 (sign) times fewer gradient bytes than the same run uncompressed."""
    configs = [
        compress_config(3, "int8", 0),
        compress_config(3, "sign", 2),
        compress_config(3, "int8", 1, "bfloat16"),
        compress_config(3, "int8", 0, "bfloat16"),
        compress_config(3, "none", 0),
    ]
    per_rank = run_distributed(_tracked, 3, configs)
    for compared in per_rank:
        for i, run in enumerate(compared):
            predicted, measured = run["predicted"], run["measured"]
            assert predicted["model_state_bytes"] == measured["model_state_bytes"], i
            assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"], i
        plain = compared[-1]["measured"]["bytes_sent_per_step"][0]["dp"]
        assert plain / compared[0]["measured"]["bytes_sent_per_step"][0]["dp"] >= 3.9
        errors = compared[0]["measured"]["model_state_bytes"][0]["grads"]
        assert errors > compared[-1]["measured"]["model_state_bytes"][0]["grads"]


def _llama(cfg: RunConfig, tie: bool) -> RunConfig:
    llama = {"arch": "llama", "name": "llama-tiny", "n_head": 4, "n_kv_head": 2}
    cfg.model = dataclasses.replace(cfg.model, **llama, ffn_hidden=40, tie_embeddings=tie)
    return resolve_and_check(cfg, cfg.parallel.nproc)


def _moe(method: str) -> RunConfig:
    cfg = tiny_config(steps=2, global_batch=16)
    cfg.model = dataclasses.replace(cfg.model, **preset("moe-tiny"), name="moe-tiny")
    cfg.model.d_model, cfg.model.max_seq_len = 32, 32
    p = cfg.parallel
    p.nproc, p.dp, p.ep, p.zero, p.compress, cfg.train.microbatches = 4, 4, 2, 1, method, 0
    return resolve_and_check(cfg, 4)


def test_on_four_ranks_the_planner_predicts_every_compressed_layout():
    """HSDP, dp 4 as 2 ZeRO-2 groups of 2, int8: within a group the reduce-scatter is exact
    (dp_shard's bytes are the uncompressed run's), across the groups (dp_replicate) the
    shard's mean in int8, 3.9 times fewer bytes. PowerSGD at rank 2 over dp 2 x tp 2
    (tensor-parallel halves of each matrix), over ZeRO-1 with a 2-stage pipeline (rank 3),
    over a tied Llama at dp 4 and rank 16, where GQA's k and v (16 x 32) are averaged
    exactly (approximating them fails this); int8 with experts over expert_dp under ZeRO-1.
    Every rank's model state and bytes by group are the planner's (with experts, but the
    routed tokens over ep, which follow the router)."""
    configs = [
        compress_config(4, "int8", 2, replicas=2),
        compress_config(4, "none", 2, replicas=2),
        compress_config(4, "powersgd", 0, dp=2, tp=2, compress_rank=2),
        compress_config(4, "powersgd", 1, dp=2, pp=2, compress_rank=3),
        _llama(compress_config(4, "powersgd", 0, compress_rank=16), tie=True),
        _moe("int8"),
    ]
    per_rank = run_distributed(_tracked, 4, configs)
    for compared in per_rank:
        for i, run in enumerate(compared):
            predicted, measured = run["predicted"], run["measured"]
            assert predicted["model_state_bytes"] == measured["model_state_bytes"], i
            sent = zip(
                predicted["bytes_sent_per_step"], measured["bytes_sent_per_step"], strict=True
            )
            for p, m in sent:
                assert {**p, "ep": 0} == {**m, "ep": 0} and (p == m or i == 5), i
        ours, plain = (run["measured"]["bytes_sent_per_step"][0] for run in compared[:2])
        assert ours["dp_shard"] == plain["dp_shard"]
        assert plain["dp_replicate"] / ours["dp_replicate"] >= 3.9
