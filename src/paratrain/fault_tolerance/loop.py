"""The training loop of a replica group under fault tolerance: a round per step.

The same build, step and finish as train/loop.py, with three differences: each step
first asks the coordinator for its round (and sits out a round that leaves it out); the
gradient is summed over the round's participants inside the step, and the update happens
only if the round commits (an aborted round restores the random generator, so computing
the step again draws what it drew); a group behind the others heals first. Each
participant trains the slice of the sample stream its round assigns (quorum.assign_slots):
under --ft-data drop its own slice of the step's global batch, which is dropped when the
group is out of the round; under replay the next slice not yet trained. quorum.jsonl
names them. Under --dp-mode diloco the rounds carry DiLoCo's outer steps instead of the
gradients' mean (outer_rounds.py, reduction.py), and checkpoints and stops wait for one."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from paratrain import checkpoint
from paratrain.checkpoint import Checkpoint
from paratrain.config import RunConfig
from paratrain.data.document_rows import training_rows
from paratrain.data.supervised import run_row_layout
from paratrain.data.tokens import BatchSampler, TokenData, on_device
from paratrain.fault_tolerance.across_groups import (
    digest,
    global_tensors,
    heal,
    state_digest,
    state_tensors,
)
from paratrain.fault_tolerance.coordinator import END
from paratrain.fault_tolerance.outer_rounds import OuterRound, outer_round
from paratrain.fault_tolerance.participant import Participant
from paratrain.fault_tolerance.quorum import (
    Fault,
    Quorum,
    parse_faults,
)
from paratrain.fault_tolerance.record import ft_data_of
from paratrain.fault_tolerance.reduction import Reduction
from paratrain.fault_tolerance.rounds import Mispredicted, RoundAborted, Rounds
from paratrain.mesh import Mesh
from paratrain.train.engine import Engine
from paratrain.train.loop import build_training, checkpoint_due, finish_training
from paratrain.train.metrics import StepMetrics, StepTimer, TrainResult
from paratrain.train.step import train_step

log = logging.getLogger(__name__)

# A hung group holds its reduction for two collective timeouts: its peers' wait ends at
# one (the round fails) and they go on without it; then it wakes, finds its round over,
# and heals from them (a hold without end would keep the run from ever finishing).
HANG_TIMEOUTS = 2
KILLED_EXIT = 43  # an injected kill's exit status: not a signal, so the agent relaunches


def group_config(cfg: RunConfig) -> RunConfig:
    """What one replica group is on its own: dp / R ranks, no replica groups."""
    p = cfg.parallel
    inner = replace(p, dp=p.dp // p.replicas, replicas=1, nproc=p.nproc // p.replicas)
    return replace(cfg, parallel=inner)


def train_in_rounds(
    cfg: RunConfig,
    mesh: Mesh,
    data: TokenData,
    participant: Participant,
    start: Checkpoint | None = None,
    on_step: Callable[[StepMetrics, bool], None] | None = None,
    run_dir: Path | None = None,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train this group until cfg.train.steps (or the coordinator's end), from `start`.
    on_step: each committed step's metrics, and whether this group is the round's saver
    (its lowest participant: checkpoints, and an early end's, say after a stop the other
    groups saw first). stop: asked after each committed step (train/preemption.py)."""
    t, p, inner = cfg.train, cfg.parallel, group_config(cfg)
    layout = run_row_layout(cfg, data.supervised)
    engine, optimizer, first, lr = build_training(inner, mesh, start, layout == "documents")
    sampler = training_rows(data, layout, t.seq_len, t.global_batch, t.seed)
    me, faults = participant.group, Injected(cfg, participant)
    timer, metrics = StepTimer(mesh.ledger), list[StepMetrics]()
    rounds = Rounds(participant, p.replicas, ft_data_of(p.replay_quorum, p.ft_data))
    outer = outer_round(cfg, optimizer)  # DiLoCo's, else None
    save = partial(_save, run_dir, engine, optimizer, mesh, inner, data, t.keep_checkpoints)
    step, stopped_at, saver = first, None, None  # saver: of the last round committed here
    while step < t.steps:
        timer.start(step)  # the step's time includes its round: the protocol's cost shows
        quorum = rounds.next(step)
        if quorum.step == END:  # before the last step: keep what was trained
            stopped_at = step if saver == me and _one_model(step, outer) and save(step) else None
            break
        joined = _join(engine, optimizer, participant, quorum, step)
        if joined is None:  # left out of the round, or copying the state failed
            rounds.unknown()
            continue
        step, rng = joined, torch.get_rng_state()
        micro_batches = _micro_batches(sampler, quorum, me, mesh, cfg)
        timer.data_done()
        reduce = faults.reduction(quorum, rounds.is_guess(quorum), step)  # a kill exits here
        reduce.for_diloco(outer, partial(state_tensors, engine, optimizer), step + 1)
        try:
            out = train_step(engine, optimizer, micro_batches, lr(step), t.grad_clip, reduce)
            reduce.after_update(engine)
        except (Mispredicted, RoundAborted) as e:
            torch.set_rng_state(rng)  # computed again, the step draws what it drew
            rounds.redo(e)
            continue
        metrics.append(timer.finish(step, out, lr(step)))
        quorum, saver = reduce.quorum, reduce.quorum.participants[0]
        if on_step is not None:
            on_step(metrics[-1], me == saver)
        step += 1
        rounds.ended(quorum, committed=True)
        stopped_at = step if _stop_now(step, t.steps, stop, outer) else None
        if (stopped_at is not None or _checkpoint_due(step, t, outer)) and me == saver:
            save(step)
        if stopped_at is not None:
            break
    return _finished(inner, engine, optimizer, data, metrics, first, stopped_at, mesh)


def _finished(
    inner: RunConfig,
    engine: Engine,
    optimizer: Any,
    data: TokenData,
    metrics: list[StepMetrics],
    first: int,
    stopped_at: int | None,
    mesh: Mesh,
) -> TrainResult:
    """train/loop.py's end, with the group's state digests (taken before `finish` changes
    the layout): the whole state's, and under DiLoCo the global state's."""
    state = state_digest(engine, optimizer, mesh.control)
    global_state = digest(global_tensors(optimizer), mesh.control)
    result = finish_training(
        inner, engine, optimizer, data, metrics, first, stopped_at, mesh.device
    )
    result.extra["state_digest"] = state
    if optimizer.outer is not None:
        result.extra["global_digest"] = global_state
    return result


def _checkpoint_due(done: int, t: Any, outer: OuterRound | None) -> bool:
    return outer.checkpoint_due(done, t.checkpoint_every) if outer else checkpoint_due(done, t)


def _one_model(done: int, outer: OuterRound | None) -> bool:
    """Whether the groups hold one model after `done` steps: always, but under DiLoCo only
    after an outer step."""
    return outer is None or outer.due(done)


def _stop_now(done: int, steps: int, stop: Callable[[], bool] | None, outer: Any) -> bool:
    """A stop asked for (collective over the group): after this step, or under DiLoCo after
    the block's outer step, so that its checkpoint holds one model."""
    return stop is not None and done < steps and _one_model(done, outer) and stop()


def _save(
    run_dir: Path | None,
    engine: Engine,
    optimizer: Any,
    mesh: Mesh,
    cfg: RunConfig,
    data: TokenData,
    keep: int,
    step: int,
) -> bool:
    """Save the state after `step` steps, unless the run has a checkpoint as late (a
    group that fell behind the others' last round keeps nothing older)."""
    latest = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
    if run_dir is None or (latest is not None and latest.step >= step):
        return False
    checkpoint.save(run_dir, step, engine, optimizer, mesh, cfg, data.fingerprint, keep)
    return True


def _micro_batches(
    sampler: BatchSampler, quorum: Quorum, group: int, mesh: Mesh, cfg: RunConfig
) -> list[torch.Tensor]:
    """This rank's micro-batches, on its device, of the slice of the sample stream that the
    round assigns to its group."""
    p, t = cfg.parallel, cfg.train
    batch, slice_ = divmod(quorum.slot_of(group), p.replicas)
    replica = slice_ * (p.dp // p.replicas) + mesh.group("dp").rank
    rows = sampler.replica_microbatches(batch, replica, p.dp, t.micro_batch)
    return on_device(rows, mesh.device)


class Injected:
    """This group's `--inject-fault`s; each fires once, whichever incarnation of the group
    gets to its step first (the coordinator's store remembers)."""

    def __init__(self, cfg: RunConfig, participant: Participant) -> None:
        p, t = cfg.parallel, cfg.train
        self.faults = set(parse_faults(p.inject_fault, p.replicas, t.steps))
        self.participant, self.hold_s = participant, HANG_TIMEOUTS * p.comm_timeout_s

    def fires(self, kind: str, step: int) -> bool:
        fault = Fault(kind, self.participant.group, step)
        return fault in self.faults and self.participant.first_time(f"{kind}/{step}")

    def reduction(self, quorum: Quorum, guessed: bool, step: int) -> Reduction:
        """The reduction of `step` (0-based), as its faults make it."""
        if self.fires("kill", step + 1):
            group = self.participant.group
            log.warning("injected kill of replica group %d at step %d", group, step + 1)
            os._exit(KILLED_EXIT)
        hold = self.hold_s if self.fires("hang", step + 1) else 0.0
        fail = self.fires("allreduce-error", step + 1)
        return Reduction(self.participant, quorum, guessed, fail, hold)


def _join(
    engine: Engine, optimizer: Any, participant: Participant, quorum: Quorum, step: int
) -> int | None:
    """The step this group computes in the round; None when the round leaves it out, or
    when copying the state to a group behind failed (a peer died: then this group has voted
    the round down)."""
    if participant.group not in quorum.participants:
        return None
    try:
        return _healed(engine, optimizer, participant, quorum, step)
    except RuntimeError as e:
        log.warning("round %d: copying the state failed: %s", quorum.round, e)
        participant.vote(quorum, False)
        return None


def _healed(
    engine: Engine, optimizer: Any, participant: Participant, quorum: Quorum, step: int
) -> int:
    """The step this group computes in `quorum`: its own, or, when a participant is behind,
    the others' after every participant has taken part in copying the state to it."""
    if not quorum.heal:  # `decide` computes the furthest step and heals every group behind
        assert step == quorum.step, f"round {quorum.round}: step {quorum.step + 1}, not {step + 1}"
        return step
    (source,) = {s for _, s in quorum.heal}
    behind = participant.group in dict(quorum.heal)
    if behind:
        log.warning("replica group %d at step %d: copying the state of group %d at step %d",
                    participant.group, step + 1, source, quorum.step + 1)  # fmt: skip
    src = quorum.participants.index(source)
    heal(engine, optimizer, participant.across(quorum), src, receive=behind)
    return quorum.step
