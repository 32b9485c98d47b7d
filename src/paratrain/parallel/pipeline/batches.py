"""A schedule's messages as NCCL needs them: group calls that pair up, placed in time.

ProcessGroupNCCL runs unbatched send/recv between two ranks on one stream per pair, in
issue order, each call blocking that stream until it is matched. Posting a stage's
receives ahead, as gloo allows, deadlocks there: at pp 2 with 4 micro-batches under 1F1B,
stage 1's send of gradient 0 waits behind its early receive of activation 2, which stage 0
sends only once it has gradient 0 (issue 28). Batching each run of a stage's
communication actions into one group call, as torch.distributed.pipelining does, is not
enough either: interleaved schedules at S = 2 then cross two calls that each wait for a
part of the other's next call.

So the messages travel in *exchanges*: two neighbouring stages issue one group call each
(`comm.post`: one `batch_isend_irecv`, one NCCL group call whose parts progress
together), carrying every message either has computed for the other and not yet sent, in
its send order; the two calls match each other exactly. `plan_calls` places them by
simulating the schedule in time (unit costs, as check.py): a stage that sends to a
neighbour already waiting for a message exchanges at once, after its SEND; a stage that
needs a message the neighbour has computed exchanges where it waits; a message not yet
computed is carried by the neighbour's exchange after its SEND. Every exchange is formed
while both stages stand at the points where they issue it, and every stage issues its
exchanges in the order they were formed, so each completes once the earlier ones have:
no schedule can hang on NCCL's streams (stream_check.py proves it for every schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.parallel.pipeline.schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    Action,
    Costs,
    Message,
    MessageKey,
    Schedule,
    message_key,
)


@dataclass(frozen=True)
class Batch:
    """One group call of a stage, issued before its action `at` (len(actions): after the
    last), in the order of the stage's list."""

    at: int
    sends: tuple[Message, ...]  # in this stage's send order
    recvs: tuple[Message, ...]  # in the peer's send order


@dataclass
class _Stage:
    actions: tuple[Action, ...]
    pc: int = 0
    clock: float = 0.0
    waiting: bool = False  # stopped at a RECV whose message has not come
    inbox: dict[MessageKey, float] = field(default_factory=dict)  # key -> when it was sent
    calls: list[Batch] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pc == len(self.actions)


def plan_calls(schedule: Schedule, costs: Costs | None = None) -> tuple[tuple[Batch, ...], ...]:
    """Every stage's group calls, in issue order (see the module docstring)."""
    costs = costs or Costs()
    s_ = schedule.num_stages
    stages = [_Stage(actions) for actions in schedule.stages]
    while not all(st.done for st in stages):
        ready = [i for i, st in enumerate(stages) if not st.done and not st.waiting]
        if not ready:  # check_schedule has proven the schedule; this cannot happen
            raise RuntimeError(f"{schedule.name}: every stage waits")
        index = min(ready, key=lambda i: (stages[i].clock, i))
        st = stages[index]
        a = st.actions[st.pc]
        if a.kind in COMPUTE:
            st.clock += costs.of(a.kind)
            st.pc += 1
        elif a.kind in (RECV_F, RECV_B):
            _, key = message_key(a.kind, a.microbatch, a.chunk, index, s_)
            if key in st.inbox:
                st.clock = max(st.clock, st.inbox.pop(key))
                st.pc += 1
            else:
                st.waiting = True
        else:
            dst, key = message_key(a.kind, a.microbatch, a.chunk, index, s_)
            st.pc += 1
            _exchange(st, index, stages[dst], dst, key)
    return tuple(tuple(st.calls) for st in stages)


def _exchange(sender: _Stage, src: int, receiver: _Stage, dst: int, key: MessageKey) -> None:
    """One message, sent in a call right after its SEND and received in a call posted as
    early as the receiver's order of calls allows: right after its previous call, so that
    the message travels during compute (gloo moves a message only into a posted receive).
    The receiver waits for it only at the message's RECV."""
    sender.calls.append(Batch(sender.pc, ((dst, key),), ()))
    receiver.calls.append(Batch(receiver.calls[-1].at if receiver.calls else 0, (), ((src, key),)))
    receiver.inbox[key] = sender.clock
    receiver.waiting = False
