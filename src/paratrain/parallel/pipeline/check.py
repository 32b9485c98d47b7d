"""Prove a schedule complete and deadlock-free before it runs, and simulate its timeline.

Two passes over a `Schedule`:
1. Static: every forward and backward of every (micro-batch, chunk) on every stage exactly
   once, every peer the neighbour that owns the other end.
2. Simulation, with the runtime's semantics: each stage runs its actions in order; a
   compute action takes its cost; a send never blocks and stamps its message with the
   sender's clock; a receive blocks until its message was sent. Dependencies are checked
   as the stages go (a forward needs its received input, a backward its forward and its
   received gradient, a send what it sends). If every unfinished stage waits on a receive,
   the wait-for graph names the cycle, or the peer that finished without sending; messages
   left at the end are unmatched sends.

The simulated timeline is the event-driven one of issue 7: each action starts as soon as
its inputs are ready, with unit cost per chunk-forward and chunk-backward by default. From
it follow the bubble (idle over total time, per stage) and the peak number of
(micro-batch, chunk) activations a stage holds: held from F until B (or until BW when the
backward is split, since the weight gradient still needs the layer inputs).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from paratrain.parallel.pipeline.schedules import (
    BI,
    BW,
    COMM,
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    Costs,
    F,
    MessageKey,
    Schedule,
    ScheduleError,
    message_key,
    virtual_stage,
)
from paratrain.parallel.pipeline.stream_check import check_streams


@dataclass(frozen=True)
class Slot:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    schedule: Schedule
    costs: Costs
    slots: tuple[tuple[Slot, ...], ...]  # slots[s]: compute actions of stage s with times
    peak_in_flight: tuple[int, ...]  # per stage: most (micro-batch, chunk) activations held

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.slots if row), default=0.0)

    def busy(self, stage: int) -> float:
        return sum(slot.end - slot.start for slot in self.slots[stage])

    def bubble_fraction(self, stage: int | None = None) -> float:
        """Idle over total step time on `stage`, or averaged over all stages if None."""
        if self.makespan == 0:
            return 0.0
        stages = range(len(self.slots)) if stage is None else [stage]
        idle = sum(self.makespan - self.busy(s) for s in stages)
        return idle / (self.makespan * len(stages))


def _static_check(schedule: Schedule) -> None:
    s_, k, v = schedule.num_stages, schedule.num_microbatches, schedule.chunks
    if len(schedule.stages) != s_:
        raise ScheduleError(f"schedule has {len(schedule.stages)} stage lists for {s_} stages")
    for stage, actions in enumerate(schedule.stages):
        for i, a in enumerate(actions):
            where = f"stage {stage} action #{i} {a}"
            if a.kind not in COMPUTE + COMM:
                raise ScheduleError(f"{where}: unknown kind {a.kind!r}")
            if not (0 <= a.microbatch < k and 0 <= a.chunk < v):
                raise ScheduleError(f"{where}: micro-batch or chunk outside K={k}, v={v}")
            if a.kind in COMM and s_ == 1:
                raise ScheduleError(f"{where}: a single stage sends no messages")
            if a.kind in COMM:
                want = (stage + (1 if a.kind in (SEND_F, RECV_B) else -1)) % s_
                if a.peer != want:
                    raise ScheduleError(f"{where}: peer must be stage {want} (S={s_})")
            if schedule.forward_only and a.kind not in (F, SEND_F, RECV_F):
                raise ScheduleError(f"{where}: a forward-only schedule has no backward")
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in actions if a.kind in COMPUTE)
        for mb in range(k):
            for c in range(v):
                n = {kind: counts[(kind, mb, c)] for kind in COMPUTE}
                what = f"stage {stage}: micro-batch {mb} chunk {c}"
                if n[F] != 1:
                    raise ScheduleError(f"{what} has {n[F]} forwards (must be exactly 1)")
                if schedule.forward_only:
                    continue
                if (n[B], n[BI], n[BW]) not in ((1, 0, 0), (0, 1, 1)):
                    raise ScheduleError(
                        f"{what} has B x{n[B]}, BI x{n[BI]}, BW x{n[BW]}; a backward must "
                        "appear exactly once, as B or as BI + BW"
                    )


class _Stage:
    """One stage's progress in the simulation."""

    def __init__(self, actions: tuple[Action, ...]) -> None:
        self.actions, self.pc, self.clock = actions, 0, 0.0
        self.done: set[tuple[str, int, int]] = set()  # (kind, mb, chunk) finished here
        self.received: set[MessageKey] = set()
        self.sent: set[tuple[int, MessageKey]] = set()  # (destination, key): sent once
        self.slots: list[Slot] = []
        self.in_flight = self.peak = 0

    @property
    def finished(self) -> bool:
        return self.pc == len(self.actions)


def check_schedule(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Raise ScheduleError saying what is wrong, or return the simulated timeline."""
    costs = costs or Costs()
    _static_check(schedule)
    stages = [_Stage(actions) for actions in schedule.stages]
    channels: dict[tuple[int, int], dict[MessageKey, float]] = {}  # (src, dst) -> key -> time
    while not all(st.finished for st in stages):
        progressed = False
        for index, st in enumerate(stages):
            while not st.finished and _step(schedule, index, st, channels, costs):
                progressed = True
        if not progressed:
            raise ScheduleError(_explain_wait(schedule, stages))
    check_streams(schedule)  # and the runtime's group calls complete under NCCL's order
    for (src, dst), pending in channels.items():
        if pending:
            key = next(iter(pending))
            raise ScheduleError(
                f"unmatched send: stage {src} sent {key[0]} of micro-batch {key[1]} "
                f"(chunk {key[2]} on the receiver) to stage {dst}, which never receives it"
            )
    return Simulation(
        schedule, costs, tuple(tuple(st.slots) for st in stages), tuple(st.peak for st in stages)
    )


def _step(
    schedule: Schedule,
    stage: int,
    st: _Stage,
    channels: dict[tuple[int, int], dict[MessageKey, float]],
    costs: Costs,
) -> bool:
    """Run the stage's next action if it can; False if it waits on a receive."""
    a = st.actions[st.pc]
    s_, last = schedule.num_stages, schedule.num_virtual_stages - 1
    where = f"stage {stage} action #{st.pc} {a}"
    if a.kind in (RECV_F, RECV_B):
        _, key = message_key(a.kind, a.microbatch, a.chunk, stage, s_)
        assert a.peer is not None, where  # every RECV names its peer (schedules.py)
        pending = channels.get((a.peer, stage), {})
        if key not in pending:
            return False
        st.clock = max(st.clock, pending.pop(key))
        st.received.add(key)
    elif a.kind in (SEND_F, SEND_B):
        needed = [F] if a.kind == SEND_F else [B, BI]
        if not any((kind, a.microbatch, a.chunk) in st.done for kind in needed):
            raise ScheduleError(f"{where}: sends before {'/'.join(needed)} computed it")
        dst, key = message_key(a.kind, a.microbatch, a.chunk, stage, s_)
        if (dst, key) in st.sent:
            raise ScheduleError(f"{where}: sends the same message twice")
        st.sent.add((dst, key))
        channels.setdefault((stage, dst), {})[key] = st.clock
    else:
        vs = virtual_stage(stage, a.chunk, s_)
        missing = _missing_input(a, vs, last, s_, st)
        if missing:
            raise ScheduleError(f"{where}: runs before {missing}")
        start = st.clock
        st.clock += costs.of(a.kind)
        st.slots.append(Slot(start, st.clock, a))
        if a.kind == F and not schedule.forward_only:
            st.in_flight += 1
            st.peak = max(st.peak, st.in_flight)
        elif a.kind in (B, BW):
            st.in_flight -= 1
    if a.kind in COMPUTE:
        st.done.add((a.kind, a.microbatch, a.chunk))
    st.pc += 1
    return True


def _missing_input(a: Action, vs: int, last: int, s_: int, st: _Stage) -> str:
    """What a compute action still lacks on its stage, or '' if it may run."""
    mb, c = a.microbatch, a.chunk
    if a.kind == F:
        if vs == 0:
            return ""
        if s_ == 1:  # the previous chunk is on this stage
            return "" if (F, mb, c - 1) in st.done else f"F{mb}.{c - 1} (its input)"
        return "" if ("act", mb, c) in st.received else "its input activation was received"
    if a.kind == BW:
        return "" if (BI, mb, c) in st.done else f"BI{mb}.{c}"
    if (F, mb, c) not in st.done:
        return f"F{mb}.{c}"
    if vs == last:
        return ""
    if s_ == 1:
        ok = (B, mb, c + 1) in st.done or (BI, mb, c + 1) in st.done
        return "" if ok else f"the backward of chunk {c + 1} (its output gradient)"
    return "" if ("grad", mb, c) in st.received else "its output gradient was received"


def _explain_wait(schedule: Schedule, stages: list[_Stage]) -> str:
    """Every unfinished stage waits on a receive: name the cycle or the silent peer."""

    def waiting(s: int) -> str:
        return f"stage {s} (action #{stages[s].pc} {stages[s].actions[stages[s].pc]})"

    start = next(s for s, st in enumerate(stages) if not st.finished)
    path: list[int] = []
    s = start
    while s not in path:
        path.append(s)
        peer = stages[s].actions[stages[s].pc].peer
        assert peer is not None  # only receives block
        if stages[peer].finished:
            return (
                f"unmatched receive: {waiting(s)} waits for stage {peer}, which finished "
                "without sending it"
            )
        s = peer
    cycle = path[path.index(s) :] + [s]
    chain = " waits for ".join(waiting(x) for x in cycle[:-1])
    return f"cyclic wait (deadlock): {chain} waits for stage {cycle[-1]}"
