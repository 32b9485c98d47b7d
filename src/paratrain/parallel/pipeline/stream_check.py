"""Prove a schedule's group calls complete under NCCL's stream semantics (issue 28).

check.py's simulation models gloo: a send never blocks, a receive waits for its message.
NCCL is stricter, and this pass models it for the group calls the runtime issues
(batches.py: plan_calls): each stage's group calls run one at a time on the pp group's stream, in
issue order; a call completes once every one of its messages is matched by the peer's
call then running on the peer's stream (the k-th message from i to j with j's k-th
receive from i); the host issues each call before the action it is placed at and goes on
at once, waiting only at a RECV for the call that receives its message. If no stream can
progress, the schedule would hang on NCCL: ScheduleError names each stage's running call
and its unmatched messages.
"""

from __future__ import annotations

from paratrain.parallel.pipeline.batches import Batch, plan_calls
from paratrain.parallel.pipeline.schedules import (
    RECV_B,
    RECV_F,
    Message,
    Schedule,
    ScheduleError,
    message_key,
)


class _Stream:
    """A stage's host (its actions) and its stream (its calls, run in order)."""

    def __init__(self, batches: tuple[Batch, ...], schedule: Schedule, stage: int) -> None:
        self.batches, self.schedule, self.stage = batches, schedule, stage
        self.actions = schedule.stages[stage]
        self.pc = 0  # the host's next action
        self.issued = 0  # calls the host has issued
        self.done = 0  # calls completed, in order: batches[done] is running if issued
        self.matched: set[tuple[str, int]] = set()  # of the running call: ('send'|'recv', i)
        self.receiving = {key: b for b, call in enumerate(batches) for _, key in call.recvs}

    def advance_host(self) -> bool:
        """Issue calls and run actions until a RECV whose call has not completed."""
        progressed = False
        while True:
            while self.issued < len(self.batches) and self.batches[self.issued].at <= self.pc:
                self.issued += 1
                progressed = True
            if self.pc == len(self.actions):
                return progressed
            a = self.actions[self.pc]
            if a.kind in (RECV_F, RECV_B):
                s_ = self.schedule.num_stages
                _, key = message_key(a.kind, a.microbatch, a.chunk, self.stage, s_)
                if key not in self.receiving:
                    raise ScheduleError(f"stage {self.stage}: {a} is received by no call")
                if self.receiving[key] >= self.done:
                    return progressed
            self.pc += 1
            progressed = True

    def running(self) -> Batch | None:
        return self.batches[self.done] if self.done < self.issued else None


def check_streams(schedule: Schedule, calls: tuple[tuple[Batch, ...], ...] | None = None) -> None:
    """Raise ScheduleError if the runtime's group calls (or `calls`, per stage) would hang
    on NCCL."""
    s_ = schedule.num_stages
    if s_ == 1:
        return
    streams = [_Stream(c, schedule, s) for s, c in enumerate(calls or plan_calls(schedule))]
    # Per ordered pair (src, dst): messages matched so far; NCCL pairs them in order.
    paired: dict[tuple[int, int], int] = {}
    ordinal = [_ordinals(st.batches, s) for s, st in enumerate(streams)]
    while not all(st.done == len(st.batches) and st.pc == len(st.actions) for st in streams):
        progressed = False
        for st in streams:
            progressed |= st.advance_host()
        for src in range(s_):
            call = streams[src].running()
            if call is None:
                continue
            for i, (dst, key) in enumerate(call.sends):
                if ("send", i) in streams[src].matched:
                    continue
                n = ordinal[src][streams[src].done][("send", i)]
                if paired.get((src, dst), 0) != n:
                    continue  # an earlier message of the pair is still unmatched
                theirs = streams[dst].running()
                if theirs is None:
                    continue
                j = _receive_of(theirs, src, n, ordinal[dst][streams[dst].done])
                if j is None:
                    continue
                if theirs.recvs[j][1] != key:
                    raise ScheduleError(
                        f"stage {dst} would receive {key} from stage {src} into the buffer "
                        f"of {theirs.recvs[j][1]}: its receives are out of the send order"
                    )
                streams[src].matched.add(("send", i))
                streams[dst].matched.add(("recv", j))
                paired[(src, dst)] = n + 1
                progressed = True
        for st in streams:
            call = st.running()
            if call is not None and len(st.matched) == len(call.sends) + len(call.recvs):
                st.done, st.matched = st.done + 1, set()
                progressed = True
        if not progressed:
            raise ScheduleError(_explain(schedule, streams))


def _ordinals(batches: tuple[Batch, ...], stage: int) -> list[dict[tuple[str, int], int]]:
    """Per call: each message's place among all messages of its pair and direction."""
    count: dict[tuple[str, int], int] = {}
    out = []
    for b in batches:
        mine: dict[tuple[str, int], int] = {}
        for kind, messages in (("send", b.sends), ("recv", b.recvs)):
            for i, (peer, _) in enumerate(messages):
                mine[(kind, i)] = count.get((kind, peer), 0)
                count[(kind, peer)] = mine[(kind, i)] + 1
        out.append(mine)
    return out


def _receive_of(call: Batch, src: int, n: int, ordinals: dict[tuple[str, int], int]) -> int | None:
    for j, (peer, _) in enumerate(call.recvs):
        if peer == src and ordinals[("recv", j)] == n:
            return j
    return None


def _describe(messages: tuple[Message, ...], kind: str, matched: set[tuple[str, int]]) -> list[str]:
    word = "to" if kind == "send" else "from"
    return [
        f"{kind} {key[0]} {key[1]}.{key[2]} {word} stage {peer}"
        for i, (peer, key) in enumerate(messages)
        if (kind, i) not in matched
    ]


def _explain(schedule: Schedule, streams: list[_Stream]) -> str:
    lines = [f"{schedule.name} S={schedule.num_stages} K={schedule.num_microbatches} "
             f"v={schedule.chunks} would hang on NCCL's streams:"]  # fmt: skip
    for s, st in enumerate(streams):
        call = st.running()
        if call is None:
            continue
        waiting = _describe(call.sends, "send", st.matched)
        waiting += _describe(call.recvs, "recv", st.matched)
        lines.append(f"stage {s}: call {st.done} (action #{call.at}) waits: {', '.join(waiting)}")
    return "\n".join(lines)
