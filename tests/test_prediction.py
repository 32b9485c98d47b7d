"""`paratrain train`'s own prediction (train/prediction.py) against what the run measures.

The distributed test runs the same Tracker the worker installs around `train`, on a tiny
GPT in 2 processes (dp = 2), with the default 25 MiB gradient bucket and validation at the
end: the summary's predicted and measured model-state bytes and bytes sent per step by
group must be equal, on every rank. Both are deterministic (tensor sizes; the ledger's
ring formulas), so equality is exact.
"""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.train.loop import train
from paratrain.train.prediction import Tracker, describe, predict
from paratrain.validate import resolve
from tests.distributed import run_distributed
from tests.equivalence import tiny_config, tiny_data


def config(dp: int = 2, pp: int = 1, tp: int = 1, **parallel: object) -> RunConfig:
    cfg = tiny_config(steps=2)
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp = dp * pp * tp, dp, pp, tp
    for key, value in parallel.items():
        setattr(p, key, value)
    cfg.train.microbatches = 0
    return resolve(cfg, dp * pp * tp)


def train_and_compare(rank: int, world: int, cfg: RunConfig, data) -> dict:
    p = cfg.parallel
    mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp)
    tracker = Tracker(cfg, mesh)
    try:
        result = train(cfg, mesh, data, tracker.step_done)
    finally:
        tracker.close()
    compared = tracker.compare(result.model)  # collective, as in the worker
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
    assert per_rank[0] == per_rank[1]  # every rank reports every rank


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
    lines = describe(pred)
    assert len(lines) == 2 and "plan (rank 0)" in lines[0] and "bubble 0." in lines[1]


def test_async_data_parallel_is_not_predicted():
    cfg = config(dp=2)
    cfg.parallel.dp_mode = "async"

    class OneRank:
        global_rank = 0

    tracker = Tracker(cfg, OneRank())  # type: ignore[arg-type]
    assert tracker.prediction is None and tracker.compare(None) == {}  # type: ignore[arg-type]
