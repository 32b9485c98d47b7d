"""A round's reduction over its participants, then its vote: the gradient's mean over the
participants' tokens (HSDP under fault tolerance), or under DiLoCo a vote alone on an
inner round and, after the update, the outer step's mean on an outer round
(outer_rounds.py). A failure or an injected fault votes the round down."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from paratrain import comm
from paratrain.fault_tolerance.across_groups import mean_across
from paratrain.fault_tolerance.outer_rounds import OuterRound
from paratrain.fault_tolerance.participant import Participant
from paratrain.fault_tolerance.quorum import Quorum, computes_the_same
from paratrain.fault_tolerance.rounds import Mispredicted, RoundAborted
from paratrain.train.engine import Engine

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """--inject-fault allreduce-error: this group's reduction reports a failure."""


class Reduction:
    """The step's `across`: the mean over the participants, then the vote. Computed ahead
    (`guessed`), it first learns the round decided meanwhile and checks it is the one."""

    def __init__(
        self,
        participant: Participant,
        quorum: Quorum,
        guessed: bool,
        fail: bool,
        hold_s: float = 0.0,
    ) -> None:
        self.participant, self.quorum, self.guessed = participant, quorum, guessed
        self.fail, self.hold_s = fail, hold_s  # --inject-fault allreduce-error, hang

    outer: OuterRound | None = None  # DiLoCo's (outer_rounds.py): set by `for_diloco`
    state: Callable[[], Any] = list  # the group's state tensors, for an outer round
    done = 0  # the steps done once this round's step is

    def for_diloco(self, outer: OuterRound | None, state: Callable[[], Any], done: int) -> None:
        self.outer, self.state, self.done = outer, state, done

    def __call__(self, engine: Engine, loss: float, tokens: int) -> tuple[float, int]:
        if self.guessed:
            decided = self.participant.decision()
            if not computes_the_same(decided, self.quorum, self.participant.group):
                raise Mispredicted(decided)
            self.quorum = decided  # its generation and participants, which may differ
        if self.outer is not None:  # DiLoCo: each group steps on its own gradient
            if self.outer.due(self.done):  # the vote waits for the outer mean
                self.outer.keep(self.state())
            elif not self.participant.vote(self.quorum, self._peers_alive()):
                raise RoundAborted(self.quorum)
            return loss, tokens
        ok = True
        if self.hold_s:
            log.warning("injected hang at step %d: holding the reduction for %.0f s",
                        self.quorum.step + 1, self.hold_s)  # fmt: skip
            time.sleep(self.hold_s)
        try:
            loss, tokens = mean_across(engine, self.participant.across(self.quorum), loss, tokens)
            if self.fail:
                raise InjectedFault(f"injected allreduce-error at step {self.quorum.step + 1}")
        except RuntimeError as e:  # a peer died (gloo's error, or our timeout), or injected
            log.warning("round %d: the reduction failed: %s", self.quorum.round, e)
            ok = False
        if not self.participant.vote(self.quorum, ok):
            raise RoundAborted(self.quorum)
        return loss, tokens

    def _peers_alive(self) -> bool:
        """An inner DiLoCo round's one collective across the groups, a flag: a peer that
        died fails it at once, as HSDP's mean does, so that the round is voted down now
        instead of waiting out the dead group's heartbeat (while its relaunch, beating
        again, would find this round still open). False too for an injected failure."""
        flag = torch.ones(1, dtype=torch.float64, device="cpu")  # the cross-group group is gloo
        try:
            comm.all_reduce(flag, self.participant.across(self.quorum))
        except RuntimeError as e:  # a peer died (gloo's error, or our timeout)
            log.warning("round %d: a peer is gone: %s", self.quorum.round, e)
            return False
        return not self.fail

    def after_update(self, engine: Engine) -> None:
        """DiLoCo's outer round, after its inner update (outer_rounds.py); else nothing."""
        if self.outer is None or not self.outer.due(self.done):
            return
        ok, started = True, None
        try:
            started = self.outer.mean(self.participant.across(self.quorum))
            if self.fail:
                raise InjectedFault(f"injected allreduce-error at step {self.done}")
        except RuntimeError as e:  # a peer died (gloo's error, or our timeout), or injected
            log.warning("round %d: the outer step failed: %s", self.quorum.round, e)
            ok = False
        if not self.participant.vote(self.quorum, ok) or started is None:
            self.outer.put_back(self.state(), engine)
            raise RoundAborted(self.quorum)
        self.outer.land(started)
