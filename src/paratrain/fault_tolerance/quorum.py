"""The protocol's pure pieces: the round's decision, the samples a group trains, the
faults a user asks for. No I/O here; coordinator.py and participant.py move these."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

FAULT_KINDS = ("kill", "hang", "allreduce-error")


@dataclass(frozen=True)
class Quorum:
    """One round's decision, as the coordinator publishes it.

    step: the step (0-based, the loop's index) the participants compute.
    generation: the cross-group process groups' generation; a new one whenever the
        participants change or a round failed (a failed gloo group is not reused).
    participants: group ids, ascending: a group's rank in the cross-group groups is its
        index here.
    heal: (group, source) pairs: the group is behind and copies the whole training state
        from the source before computing.
    slots: per participant, the slice of the sample stream it trains (`samples`).
    incarnations: per participant, the incarnation of the group that asked (its leader's
        count of launches): a relaunched group does not take a round decided on an ask of
        the incarnation before it.
    """

    round: int
    step: int
    generation: int
    participants: tuple[int, ...]
    heal: tuple[tuple[int, int], ...] = ()
    slots: tuple[int, ...] = ()
    incarnations: tuple[int, ...] = ()

    def slot_of(self, group: int) -> int:
        return self.slots[self.participants.index(group)]

    def asked_by(self, group: int, incarnation: int) -> bool:
        """Whether the round, if `group` takes part, was decided on that incarnation's ask."""
        if group not in self.participants:
            return True
        return self.incarnations[self.participants.index(group)] == incarnation

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Quorum:
        d = json.loads(text)
        heal = tuple((int(g), int(s)) for g, s in d["heal"])
        participants, slots = tuple(d["participants"]), tuple(d["slots"])
        incarnations = tuple(d["incarnations"])
        return cls(d["round"], d["step"], d["generation"], participants, heal, slots, incarnations)


@dataclass(frozen=True)
class Decision:
    step: int
    participants: tuple[int, ...]
    heal: tuple[tuple[int, int], ...]
    slots: tuple[int, ...] = ()  # a replay's, from its record; else `assign_slots` gives them


def quorum_size(min_replicas: int) -> int:
    """Participants a round needs: `--min-replicas`, and never a group alone."""
    return max(min_replicas, 2)


def decide(asks: dict[int, int], min_replicas: int) -> Decision | None:
    """The round over the groups that asked (group -> the step it is at), or None when too
    few asked. Everyone computes the furthest step; a group behind it (relaunched, or
    left out for a while) heals from the lowest-numbered group at that step."""
    if len(asks) < quorum_size(min_replicas):
        return None
    step = max(asks.values())
    source = min(g for g, s in asks.items() if s == step)
    heal = tuple((g, source) for g, s in sorted(asks.items()) if s < step)
    return Decision(step, tuple(sorted(asks)), heal)


def assign_slots(
    step: int, participants: tuple[int, ...], replicas: int, ft_data: str, committed: int
) -> tuple[int, ...]:
    """The stream slice each participant trains. The stream is the sampler's global batches
    in order, each cut into one slice per group: slot s is group s % R's slice of batch
    s // R. `drop`: each group its own slice of the step, so an absent group's is never
    trained. `replay`: the next slices after the `committed` ones, in participant order,
    so every slice is trained exactly once (later, when a group was absent)."""
    if ft_data == "replay":
        return tuple(range(committed, committed + len(participants)))
    return tuple(step * replicas + g for g in participants)


def samples(slot: int, global_batch: int, replicas: int) -> tuple[int, int]:
    """[lo, hi): the positions in the sample stream of slice `slot`."""
    per_group = global_batch // replicas
    return slot * per_group, (slot + 1) * per_group


def coordinator_address(text: str) -> tuple[str, int]:
    """--coordinator HOST:PORT, checked: ValueError with one line."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--coordinator {text!r}: expected HOST:PORT, PORT 0 to 65535")
    return host, int(port)


@dataclass(frozen=True)
class Fault:
    kind: str
    group: int
    step: int  # 1-based, as the log counts steps


def parse_faults(text: str, replicas: int, steps: int) -> list[Fault]:
    """`--inject-fault KIND:GROUP:STEP[,...]`, checked: ValueError with one line."""
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in FAULT_KINDS:
            raise ValueError(
                f"--inject-fault {item!r}: expected KIND:GROUP:STEP with KIND one of "
                f"{', '.join(FAULT_KINDS)}"
            )
        try:
            group, step = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--inject-fault {item!r}: GROUP and STEP are integers") from None
        if not 0 <= group < replicas:
            raise ValueError(
                f"--inject-fault {item!r}: group {group} does not exist; valid: 0 to {replicas - 1}"
            )
        if not 1 <= step <= steps:
            raise ValueError(
                f"--inject-fault {item!r}: step {step} does not exist; valid: 1 to {steps}"
            )
        faults.append(Fault(parts[0], group, step))
    return faults


def following(previous: Quorum, committed: bool, replicas: int, ft_data: str) -> Quorum:
    """The round after `previous` if no group comes or goes: what a group computes while
    the coordinator decides. (Under replay a round's slots run on from the count of
    slices committed before it, so `previous` gives that count.)"""
    step = previous.step + int(committed)
    trained = previous.slots[0] + len(previous.slots) * int(committed)
    slots = assign_slots(step, previous.participants, replicas, ft_data, trained)
    generation = previous.generation + (0 if committed else 1)
    return replace(
        previous, round=previous.round + 1, step=step, generation=generation, heal=(), slots=slots
    )


def computes_the_same(decided: Quorum, guess: Quorum, group: int) -> bool:
    """Whether the forward and backward that `group` computed for `guess` are the ones
    `decided` asks of it: the same step and slice, and no group to heal first."""
    return (
        group in decided.participants
        and decided.step == guess.step
        and not decided.heal
        and decided.slot_of(group) == guess.slot_of(group)
    )
