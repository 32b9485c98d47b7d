"""What each worker of a replica group runs under fault tolerance: its group's own world
and mesh, the participant, the rounds, and the group's record in RUN_DIR/groups/G/."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.comm.group import CommOptions
from paratrain.config import RunConfig
from paratrain.data.tokens import load_tokens
from paratrain.fault_tolerance.group_env import GroupEnv
from paratrain.fault_tolerance.loop import group_config, train_in_rounds
from paratrain.fault_tolerance.participant import Participant
from paratrain.mesh import Mesh
from paratrain.train import run_dir as rd
from paratrain.train.metrics import StepMetrics, TrainResult
from paratrain.train.preemption import Preemption
from paratrain.train.progress import Progress
from paratrain.train.tensorboard import TensorBoardWriter
from paratrain.train.worker import (
    WorkerEnv,
    init_process_group,
    rank_device,
    resume_point,
    run_summary,
)

log = logging.getLogger(__name__)


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir / "groups" / str(group)


def run_group_worker(cfg: RunConfig, env: WorkerEnv, group: GroupEnv) -> None:
    """Train this rank of replica group `group.group`; its rank 0 records the group's steps
    and summary (the launcher makes the run's from them)."""
    # Every group's workers share this machine's cores (--nproc is all of them, checked):
    # split by the group's own local size, two groups of one would each take every core.
    torch.set_num_threads(max(1, (torch.get_num_threads() or 1) // cfg.parallel.nproc))
    init_process_group(cfg, env)  # this group's world: env.world_size = the group's ranks
    inner = group_config(cfg)
    p = inner.parallel
    options = CommOptions(timeout_s=p.comm_timeout_s, algo=p.comm_algo, order=p.comm_order)
    device = rank_device(cfg, env)
    mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, options=options, device=device)
    participant = Participant(group, mesh, cfg.parallel.heartbeat_timeout_s, p.comm_timeout_s)
    run_dir = Path(cfg.train.out)
    record: GroupRecord | None = None
    stop = Preemption(mesh.control)  # a stop signal: save and stop
    try:
        data = load_tokens(cfg.data.path, cfg.data.val_fraction, cfg.data.tokenizer)
        # Relaunched, or --resume: from the latest checkpoint (a live peer's state replaces
        # it when there is one; when every group starts from it, the record says `rewind`)
        start = resume_point(inner, mesh, run_dir, env.restart_count)
        if mesh.global_rank == 0:
            record = GroupRecord(cfg, run_dir, group.group, start.step if start else 0)
        on_step = record.on_step if record is not None else None
        result = train_in_rounds(cfg, mesh, data, participant, start, on_step, run_dir, stop)
        if record is not None:
            record.finish(result, cfg, env.restart_count)
    finally:
        if record is not None:
            record.close()
        stop.close()
        participant.close()
        mesh.close()
    dist.destroy_process_group()


class GroupRecord:
    """What rank 0 of a replica group records: RUN_DIR/groups/G/ (metrics.jsonl, and the
    summary the launcher makes the run's from), its TensorBoard run, and progress lines
    for the steps whose round it speaks for (the round's loss is the participants' mean,
    the same in every group; the groups share the terminal: no bar)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, group: int, first_step: int) -> None:
        self.group, self.dir = group, group_dir(run_dir, group)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics: GroupMetrics | None = GroupMetrics(self.dir)
        t = cfg.train
        self.progress = Progress(t.steps, t.log_every, True, first_step, bar=False)
        self.board = TensorBoardWriter(run_dir, f"group-{group}") if t.tensorboard else None

    def on_step(self, m: StepMetrics, leading: bool) -> None:
        if self.metrics is not None:
            self.metrics.write(m)
        if self.board is not None:
            self.board.write(m)
        if leading:
            self.progress.update(m)

    def finish(self, result: TrainResult, cfg: RunConfig, restarts: int) -> None:
        if self.board is not None:
            self.board.validation(result.val_loss)
        self.close()
        if result.metrics:
            summary = run_summary(result, cfg, self.dir) | {"group": self.group}
            summary["restarts"] = restarts
            summary["last_step"] = result.metrics[-1].step
            summary["state_digest"] = result.extra["state_digest"]
            if "global_digest" in result.extra:  # DiLoCo's global parameters and momentum
                summary["global_digest"] = result.extra["global_digest"]
            rd.write_summary(self.dir, summary)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.board is not None:
            self.board.close()
            self.board = None


class GroupMetrics(rd.MetricsWriter):
    """A group's metrics.jsonl: its first step drops the rows from that step on, written
    by an earlier incarnation past where this one starts (a checkpoint, or a heal)."""

    def __init__(self, group_dir: Path) -> None:
        super().__init__(group_dir)
        self.group_dir, self.first = group_dir, True

    def write(self, m: StepMetrics) -> None:
        if self.first:
            self.first = False
            self.close()
            rd.truncate_metrics(self.group_dir, m.step - 1)
            super().__init__(self.group_dir)
        super().write(m)
