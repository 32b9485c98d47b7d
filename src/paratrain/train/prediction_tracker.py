"""The measurement `paratrain train` puts beside the planner's prediction (prediction.py):
each rank's model state at the last step's end, and the comm ledger's bytes and calls per
group between the last two step ends, gathered to every rank at the end of the run."""

from __future__ import annotations

import logging
from typing import Any

import torch

from paratrain import comm
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.plan.rank_traffic import AXES
from paratrain.train.prediction import STATE_KINDS, Prediction, describe_prediction, predict

log = logging.getLogger(__name__)


class PredictionTracker:
    """Installed around `train`: the prediction at the start, the measurement at the end.

    `step_done` (called from the loop's on_step) marks each step's end with the ledger's
    bytes by group, so evaluation traffic after the last step is not counted. The model
    state is the record `train` makes at the last step's end, which the worker hands to
    `compare` (`TrainResult.extra["model_state_bytes"]`, from train/engine.py).
    """

    def __init__(self, cfg: RunConfig, mesh: Mesh) -> None:
        self.mesh = mesh
        # train/loop.py's runs (sync, DiLoCo); not yet the parameter server's
        self.measuring = cfg.parallel.dp_mode != "async"
        self.prediction = predict(cfg) if self.measuring else None
        self.marks: list[dict[str, int]] = []
        self.last_step = 0  # none yet in this start
        if self.measuring:
            self.marks.append(self._ledger())
        if self.prediction is not None and mesh.global_rank == 0:
            for line in describe_prediction(self.prediction):
                log.info(line)

    def _ledger(self) -> dict[str, int]:
        """Bytes sent and calls so far, by group ("calls dp", ...)."""
        totals = self.mesh.ledger.totals()
        calls = {f"calls {a}": sum(t.calls for (g, _), t in totals.items() if g == a) for a in AXES}
        return {axis: self.mesh.ledger.bytes_sent(group=axis) for axis in AXES} | calls

    def step_done(self, step: int) -> None:
        """`step`: the global step just done (a resumed run's count on from its checkpoint)."""
        if self.measuring:
            self.marks.append(self._ledger())
            self.last_step = step

    def close(self) -> None:
        """Nothing to release; kept so the worker's try/finally reads the same as before."""

    def measure(self, state: dict[str, int] | None) -> list[int]:
        """This rank's model-state bytes (STATE_KINDS), last step's bytes (AXES), bytes
        from this start to the last step's end, set-up included (AXES), and last step's
        calls (AXES)."""
        state = state or {}
        before, after = self.marks[-2:] if len(self.marks) > 1 else (self.marks[0],) * 2
        return (
            [state.get(kind, 0) for kind in STATE_KINDS]
            + [after[a] - before[a] for a in AXES]
            + [after[a] - self.marks[0][a] for a in AXES]
            + [after[f"calls {a}"] - before[f"calls {a}"] for a in AXES]
        )

    def compare(self, state: dict[str, int] | None) -> dict[str, Any]:
        """Collective over the world group: {"predicted", "measured"} ("measured" alone when
        not predicted), or {} for the parameter server's runs.

        Every rank must call it (it all-gathers the ranks' measurements). `state`: this
        rank's model-state record at the last step's end (TrainResult.extra).
        """
        if not self.measuring:
            return {}
        mine = torch.tensor(self.measure(state), dtype=torch.float64, device="cpu")  # host-side
        world = self.mesh.control
        every = comm.all_gather_flat(mine, world, sizes=[mine.numel()] * world.size)
        rows = every.view(world.size, -1).tolist()
        n = len(STATE_KINDS)
        states = []
        for r in rows:
            state = dict(zip(STATE_KINDS, map(int, r[:n]), strict=True))
            states.append({**state, "total": sum(state.values())})
        a = len(AXES)
        measured = {
            "model_state_bytes": states,
            "bytes_sent_per_step": [
                dict(zip(AXES, map(int, r[n : n + a]), strict=True)) for r in rows
            ],
            "bytes_sent_total": [
                dict(zip(AXES, map(int, r[n + a : n + 2 * a]), strict=True)) for r in rows
            ],
            "calls_per_step": [
                dict(zip(AXES, map(int, r[n + 2 * a :]), strict=True)) for r in rows
            ],
            "step": self.last_step,
        }
        if self.prediction is None:
            return {"measured": measured}
        if self.mesh.global_rank == 0:
            log.info(summary_line(self.prediction, measured))
        return {"predicted": self.prediction.as_dict(), "measured": measured}


def summary_line(pred: Prediction, measured: dict[str, Any]) -> str:
    """Predicted beside measured for rank 0, in one log line."""
    p_state, m_state = pred.model_state[0], measured["model_state_bytes"][0]
    p_sent, m_sent = pred.bytes_per_step[0], measured["bytes_sent_per_step"][0]
    sent = ", ".join(f"{a} {p_sent[a]:,} / {m_sent[a]:,}" for a in AXES if p_sent[a] or m_sent[a])
    items = ", ".join(f"{k} {p_state[k]:,} / {m_state[k]:,}" for k in STATE_KINDS)
    return (
        f"predicted / measured (rank 0): model state {p_state['total']:,} / "
        f"{m_state['total']:,} bytes ({items})"
        # No step ran here (a resumed run that was already complete): no traffic to compare.
        + (f"; bytes sent in step {measured['step']}: {sent}" if sent and measured["step"] else "")
    )
