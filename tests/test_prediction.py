"""`paratrain train`'s own prediction (train/prediction.py) against what the run measures.

The distributed tests run the same PredictionTracker the worker installs around `train`, on a tiny
GPT (dp = 2, and dp = 3 under ZeRO), with the default 25 MiB gradient bucket and
validation at the end: the summary's predicted and measured model-state bytes and bytes
sent per step by group must be equal, on every rank. Both are deterministic (tensor sizes,
the runtime's own record of its flat buffers; the ledger's ring formulas), so equality is
exact. The tiny GPT has 42,880 parameters, which 3 does not divide: its ZeRO buffers are
padded, and the padding must be predicted too.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from paratrain.comm.ledger import Ledger
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.presets import preset
from paratrain.plan.rank_memory import padding_bytes
from paratrain.train.loop import train
from paratrain.train.prediction import describe_prediction, planner_inputs, predict
from paratrain.train.prediction_tracker import PredictionTracker
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data


def config(dp: int = 2, pp: int = 1, tp: int = 1, **parallel: object) -> RunConfig:
    cfg = tiny_config(steps=2, global_batch=4 * dp)  # b = 2: K = 2 micro-batches
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp = dp * pp * tp, dp, pp, tp
    for key, value in parallel.items():
        setattr(p, key, value)
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, p.nproc)


def train_tracked(cfg: RunConfig, data, ledger: Ledger | None = None) -> tuple:
    """Train under the PredictionTracker the worker installs: the result, the summary's predicted
    and measured numbers (collective, as in the worker) and the mesh, for the caller to
    read and close."""
    p = cfg.parallel
    mesh = Mesh.build(
        dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, ledger=ledger, replicas=p.replicas
    )
    tracker = PredictionTracker(cfg, mesh)
    try:
        result = train(cfg, mesh, data, lambda m: tracker.step_done(m.step))
    finally:
        tracker.close()
    return result, tracker.compare(result.extra["model_state_bytes"]), mesh


def calls_agree(predicted: dict, measured: dict) -> int:
    """Calls per group equal on every rank wherever the planner counts them (None: not
    counted, plan/rank_calls.py); how many (rank, group) pairs it counted."""
    counted = 0
    for p, m in zip(predicted["calls_per_step"], measured["calls_per_step"], strict=True):
        mine = {a: c for a, c in p.items() if c is not None}
        assert mine == {a: m[a] for a in mine}
        counted += len(mine)
    return counted


def train_and_compare(rank: int, world: int, cfg: RunConfig, data) -> dict:
    _, compared, mesh = train_tracked(cfg, data)
    mesh.close()
    return compared


def test_summary_predicted_and_measured_bytes_agree_dp2():
    cfg = config(dp=2)
    per_rank = run_distributed(train_and_compare, 2, cfg, tiny_data())
    for compared in per_rank:
        predicted, measured = compared["predicted"], compared["measured"]
        assert measured["step"] == cfg.train.steps
        assert predicted["model_state_bytes"] == measured["model_state_bytes"]
        assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]
        (dp_bytes, *_) = {r["dp"] for r in measured["bytes_sent_per_step"]}
        assert dp_bytes > 0  # gradients really moved
        assert calls_agree(predicted, measured) == 2 * 10  # every group of both ranks
    assert per_rank[0] == per_rank[1]  # every rank reports every rank


@pytest.mark.parametrize(("zero", "dtype"), [(1, "float32"), (2, "bfloat16"), (3, "float32")])
def test_zero_model_state_and_bytes_agree_with_padding_dp3(zero, dtype):
    """ZeRO over 3 ranks: shards of ceil(n/3), the whole buffers padded to 3 ceil(n/3)
    (ZeRO-3: each FSDP unit on its own), all padding under params as the runtime records
    it; bytes 2(k-1)S/k per step (ZeRO-1, fp32 gradient reduction even in bf16), (K+1)
    (k-1)S/k (ZeRO-2, its default reduce-scatter per micro-batch) and 3(k-1)S/k per
    micro-batch (ZeRO-3), S padded."""
    cfg = config(dp=3, zero=zero)
    cfg.train.dtype = dtype
    model, workload, layout, _ = planner_inputs(cfg)
    padding = sum(padding_bytes(model, workload, layout).values())
    # 42,880 = 3 x 14,293 + 1: the whole ZeRO-1/2 buffers gain 2 elements; ZeRO-3's unit
    # shards (3,072 + 2 x 4,235 + 2,752) happen to add up to ceil(42,880 / 3) here.
    assert (padding > 0) == (zero < 3)
    per_rank = run_distributed(train_and_compare, 3, cfg, tiny_data())
    for compared in per_rank:
        predicted, measured = compared["predicted"], compared["measured"]
        assert predicted["model_state_bytes"] == measured["model_state_bytes"]
        assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]
        assert calls_agree(predicted, measured) == 3 * 10
    state = per_rank[0]["measured"]["model_state_bytes"][0]
    shard = -(-42_880 // 3)
    assert state["optimizer"] == 2 * 4 * shard  # fp32 m and v of one shard (padding: params)
    assert state["master"] == (4 * shard if dtype == "bfloat16" else 0)


def test_zero2_default_accumulates_into_the_shard_predicted_exactly_dp3():
    """`--zero 2` with K = 2 micro-batches and no --zero2-accumulate: the runtime
    reduce-scatters after each micro-batch (the default, "shard"), so each rank sends one
    more (k-1)S/k than with `--zero2-accumulate full`: S padded to 3 x 14,294 fp32
    elements, (k-1)S/k = 2 x 14,294 x 4 = 114,352 bytes. The step-boundary state is the
    same for both options; "full"'s transient whole gradient is a note."""
    cfg = config(dp=3, zero=2)
    assert cfg.parallel.zero2_accumulate == "shard"
    full = predict(config(dp=3, zero=2, zero2_accumulate="full"))
    assert "accumulate full" in full.notes[-1] and "0.17 MB" in full.notes[-1]  # 42,882 x 4
    per_rank = run_distributed(train_and_compare, 3, cfg, tiny_data())
    for compared in per_rank:
        predicted, measured = compared["predicted"], compared["measured"]
        assert predicted["model_state_bytes"] == measured["model_state_bytes"]
        assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]
        assert calls_agree(predicted, measured) == 3 * 10
        assert measured["model_state_bytes"] == full.model_state
        for shard, whole in zip(measured["bytes_sent_per_step"], full.bytes_per_step, strict=True):
            assert shard["dp"] - whole["dp"] == 114_352
    assert "accumulate shard" in describe_prediction(predict(cfg))[1]


def test_prediction_per_rank_for_a_3d_layout():
    cfg = config(dp=2, pp=2, tp=2, schedule="1f1b")
    pred = predict(cfg)
    assert len(pred.model_state) == 8
    # mesh order pp, dp, tp: ranks 0-3 are stage 0 (embeddings), 4-7 stage 1 (the head)
    assert len({str(s) for s in pred.model_state[:4]}) == 1
    assert pred.model_state[0] != pred.model_state[4]
    for sent in pred.bytes_per_step:
        assert sent["dp"] > 0 and sent["tp"] > 0 and sent["pp"] > 0
    assert pred.bubble == 1 / (cfg.train.microbatches + 1)
    lines = describe_prediction(pred)
    assert len(lines) == 2 and "plan (rank 0)" in lines[0] and "bubble 0." in lines[1]


def test_async_data_parallel_is_not_predicted():
    cfg = config(dp=2)
    cfg.parallel.dp_mode = "async"

    class OneRank:
        global_rank = 0

    tracker = PredictionTracker(cfg, OneRank())  # type: ignore[arg-type]
    assert tracker.prediction is None and tracker.compare(None) == {}  # type: ignore[arg-type]


def _model(arch: str, tie: bool) -> dict:
    if arch == "gpt":
        return {"tie_embeddings": tie}
    llama = {"arch": "llama", "name": "llama-tiny", "n_head": 4, "n_kv_head": 2}
    return {**llama, "ffn_hidden": 40, "tie_embeddings": tie}


# (arch, tied, dp, pp, tp, parallel options): Llama's parts (no biases, RMSNorms, GQA,
# SwiGLU, no positions) and tied embeddings (one parameter on one rank; a copy on each end
# of a pipeline; a root unit of its own under ZeRO-3), every per-rank count exact.
ARCH_CASES = [
    ("llama", False, 3, 1, 1, {"zero": 1}),
    ("llama", False, 2, 1, 1, {"zero": 3}),
    ("llama", True, 2, 1, 1, {"zero": 3}),
    ("llama", False, 1, 1, 2, {"sequence_parallel": True}),
    ("llama", True, 1, 2, 1, {"schedule": "1f1b"}),
    ("gpt", True, 2, 1, 1, {"zero": 3}),
    ("gpt", True, 1, 2, 1, {"schedule": "1f1b"}),
    # the tied table under ZeRO on both ends: summed whole over the ends, then over dp
    ("llama", True, 2, 2, 1, {"zero": 1, "schedule": "1f1b"}),
]


@pytest.mark.parametrize(("arch", "tie", "dp", "pp", "tp", "options"), ARCH_CASES)
def test_llama_and_tied_models_are_predicted_exactly(arch, tie, dp, pp, tp, options):
    cfg = config(dp=dp, pp=pp, tp=tp, **options)
    cfg.model = dataclasses.replace(cfg.model, **_model(arch, tie))
    world = dp * pp * tp
    for compared in run_distributed(
        train_and_compare, world, resolve_and_check(cfg, world), tiny_data()
    ):
        predicted, measured = compared["predicted"], compared["measured"]
        assert predicted["model_state_bytes"] == measured["model_state_bytes"]
        assert predicted["bytes_sent_per_step"] == measured["bytes_sent_per_step"]
        assert calls_agree(predicted, measured) == world * 10


def cp_and_moe_configs() -> list[RunConfig]:
    """4 ranks each: ring cp 2 x dp 2; all-to-all cp 2 x dp 2 under ZeRO-1; moe-tiny (d 32)
    at dp 4 x ep 2 under ZeRO-1, so that each expert has two replicas (expert_dp 2), and
    at pp 2 x dp 2 x ep 2 (1F1B, K = 2): each stage its block's experts and routing; and
    at dp 4 x ep 2 under ZeRO-3 with a tied head: FSDP units, each layer's experts one
    over expert_dp, the tied table a root unit not gathered again for backward; the same
    in 2 HSDP replica groups."""
    ring = config(dp=2, cp=2, nproc=4)
    ulysses = config(dp=2, cp=2, nproc=4, cp_method="alltoall", zero=1)
    moe = tiny_config(steps=2, global_batch=16)  # b = 2 at dp 4: K = 2 micro-batches
    moe.model = dataclasses.replace(moe.model, **preset("moe-tiny"), name="moe-tiny")
    moe.model.d_model, moe.model.max_seq_len = 32, 32
    p = moe.parallel
    p.nproc, p.dp, p.ep, p.zero, moe.train.microbatches = 4, 4, 2, 1, 0
    moe.train.val_batches = 0  # evaluation runs the experts too, with the last step's number
    piped = copy.deepcopy(moe)  # pp 2 x dp 2 x ep 2, plain DataParallel: a stage per block
    q = piped.parallel
    q.dp, q.pp, q.zero, q.schedule = 2, 2, 0, "1f1b"
    fsdp = copy.deepcopy(moe)
    fsdp.parallel.zero, fsdp.model.tie_embeddings = 3, True
    # dp 2 x tp 2 x ep 2, recomputed: each layer routes again in backward (its gathers and
    # all-to-alls twice, not the DataParallel buffer broadcast); tp only attention's
    recomputed = copy.deepcopy(moe)
    r = recomputed.parallel
    r.dp, r.tp, r.zero, recomputed.train.recompute = 2, 2, 0, "full"
    # HSDP, 2 replica groups of 2 ranks, each one ep group: the experts shard over their
    # group's ranks holding them (expert_shard, 1 rank here) and all-reduce across
    hsdp = copy.deepcopy(fsdp)
    hsdp.parallel.replicas = 2
    out = [
        ring,
        ulysses,
        resolve_and_check(moe, 4),
        resolve_and_check(piped, 4),
        resolve_and_check(fsdp, 4),
    ]
    return out + [resolve_and_check(recomputed, 4), resolve_and_check(hsdp, 4)]


def train_each(rank: int, world: int, configs: list[RunConfig], data) -> list[tuple]:
    """Per config: the summary's predicted and measured numbers, and the last step's ep
    all-to-all bytes split into routing counts (int64) and tokens (the rest)."""
    out = []
    for cfg in configs:
        ledger = Ledger(max_recent=100_000)  # every call of the run, for the split
        _, compared, mesh = train_tracked(cfg, data, ledger)
        mesh.close()
        last = [r for r in ledger.recent() if r.step == cfg.train.steps]
        ep = [r for r in last if r.group == "ep" and r.op == "all_to_all"]
        counts = sum(r.bytes_sent for r in ep if r.shapes.startswith("int64"))
        out.append((compared, counts, sum(r.bytes_sent for r in ep) - counts))
    return out


def test_cp_and_experts_predicted_per_rank_and_group():
    """Ring and all-to-all attention at cp 2 x dp 2, and moe-tiny at dp 4 x ep 2 (ZeRO-1;
    ZeRO-3, tied, also in 2 HSDP replica groups) and pp 2 x dp 2 x ep 2: the summary's
    model state and bytes sent per step by group (dp_cp, cp, dp, ep, expert_dp,
    dp_replicate) equal the prediction on every rank,
    exactly, but for one term: the tokens of the expert all-to-all, which follow the
    router's choices and are predicted for a balanced router (2 k N d e (ep-1)/ep per
    layer and pass). For it the test allows
    exactly that difference, and checks the measured tokens against what capacity allows:
    whole rows, at most k N sent and E/ep C received per layer, micro-batch and pass."""
    configs = cp_and_moe_configs()
    per_rank = run_distributed(train_each, 4, configs, tiny_data())
    for rank, results in enumerate(per_rank):
        for cfg, (compared, counts, tokens) in zip(configs, results, strict=True):
            predicted, measured = compared["predicted"], compared["measured"]
            assert predicted["model_state_bytes"] == measured["model_state_bytes"]
            p_sent, m_sent = predicted["bytes_sent_per_step"], measured["bytes_sent_per_step"]
            counted = calls_agree(predicted, measured)
            assert counted == (4 * 10 if cfg.parallel.cp > 1 else 0)  # experts: not counted
            if cfg.parallel.cp > 1:
                assert p_sent == m_sent
                assert m_sent[rank]["cp"] > 0 and m_sent[rank]["dp_cp"] > 0
                continue
            m, k, routed = cfg.model, cfg.train.microbatches, predicted["routed_bytes_per_step"]
            exact = {g: v for g, v in p_sent[rank].items() if g != "ep"}
            assert exact == {g: v for g, v in m_sent[rank].items() if g != "ep"}
            hsdp = cfg.parallel.replicas > 1  # the experts' shards: all-reduced across
            assert (exact["expert_dp"] > 0) == (cfg.parallel.dp > cfg.parallel.ep and not hsdp)
            assert (exact["dp_replicate"] > 0) == hsdp
            assert counts > 0 and routed[rank] > 0
            assert (exact["pp"] > 0) == (cfg.parallel.pp > 1)
            # everything on ep but the routed tokens is exact: counts, norms
            assert m_sent[rank]["ep"] - tokens == p_sent[rank]["ep"] - routed[rank]
            row, n = m.d_model * 4, cfg.train.micro_batch * cfg.train.seq_len
            capacity = math.ceil(m.capacity_factor * m.top_k * n * cfg.parallel.dp / m.num_experts)
            rows = m.top_k * n + m.num_experts // cfg.parallel.ep * capacity
            passes = 2 + (cfg.train.recompute != "none")  # a recomputed forward's too
            assert tokens % row == 0 and 0 < tokens <= k * m.n_layer * passes * rows * row


def test_dry_run_lines_show_cp_and_ep_with_each_ranks_own_prediction():
    """No process: every rank's line names its cp and ep place and carries that rank's
    model state and bytes per step, the cp group's and the experts' traffic included."""
    from paratrain.train.dry_run import dry_run_lines
    from paratrain.train.prediction import MB

    ring, _, moe, *_ = cp_and_moe_configs()
    for cfg, group in ((ring, "cp"), (moe, "ep")):
        pred = predict(cfg)
        ranks = [line for line in dry_run_lines(cfg, "data") if line.startswith("rank ")]
        for rank, line in enumerate(ranks):
            sent, state = pred.bytes_per_step[rank], pred.model_state[rank]["total"]
            assert sent[group] > 0
            assert f"model state {state / MB:.2f} MB" in line
            assert f"sends {sum(sent.values()) / MB:.3f} MB per step" in line
        if cfg is ring:
            assert ranks[1].startswith("rank 1: pp 0, dp 0, cp 1, tp 0:")
            assert ranks[2].startswith("rank 2: pp 0, dp 1, cp 0, tp 0:")
        else:
            assert ", ep 1:" in ranks[1] and ", ep 0:" in ranks[2]
