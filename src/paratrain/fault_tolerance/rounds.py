"""The rounds as a replica group meets them: asked for at each step and, when the group can
tell what the next round will be (the last one again, one step on), computed ahead while
the coordinator decides it; otherwise learnt first. The reduction learns the decided round
after the backward and hands it back here when it is not the one computed."""

from __future__ import annotations

from paratrain.fault_tolerance.participant import Participant
from paratrain.fault_tolerance.quorum import Quorum, following


class RoundAborted(RuntimeError):
    """The coordinator did not commit the round: no group updates."""

    def __init__(self, quorum: Quorum) -> None:
        super().__init__(f"round {quorum.round} was not committed")
        self.quorum = quorum


class Mispredicted(RuntimeError):
    """The round decided is not the one this group computed ahead: compute it as decided."""

    def __init__(self, decided: Quorum) -> None:
        super().__init__(f"round {decided.round} is not the round computed ahead")
        self.decided = decided


class Rounds:
    def __init__(self, participant: Participant, replicas: int, ft_data: str) -> None:
        self.participant, self.replicas, self.ft_data = participant, replicas, ft_data
        self.guess: Quorum | None = None  # the round expected next
        self.decided: Quorum | None = None  # a round learnt but not yet computed

    def next(self, step: int) -> Quorum:
        """The round to compute at `step`: decided, or guessed (`is_guess`)."""
        if self.decided is None:
            self.participant.ask(step)
            if self.guess is None:
                self.decided = self.participant.decision()
        quorum = self.decided if self.decided is not None else self.guess
        assert quorum is not None
        self.decided = None
        return quorum

    def is_guess(self, quorum: Quorum) -> bool:
        return quorum is self.guess

    def unknown(self) -> None:
        """The next round cannot be told (this group sat one out, or a heal failed)."""
        self.guess = None

    def learnt(self, decided: Quorum) -> None:
        """The round decided was not the one computed: compute it next."""
        self.guess, self.decided = None, decided

    def ended(self, quorum: Quorum, committed: bool) -> None:
        self.guess = following(quorum, committed, self.replicas, self.ft_data)

    def redo(self, why: Mispredicted | RoundAborted) -> None:
        """The step is computed again: as decided, or in the round after the aborted one."""
        if isinstance(why, Mispredicted):
            self.learnt(why.decided)
        else:
            self.ended(why.quorum, committed=False)
