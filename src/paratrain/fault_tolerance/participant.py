"""A replica group's side of the protocol: its leader (the group's rank 0) asks for each
round, beats its heart and votes; every rank of the group learns the quorum and the
commit from the leader, and reaches its peers in the other groups (the ranks at its own
position) over a gloo process group of the quorum's generation.

The cross-group process groups live outside this group's torch.distributed world (each
group is its own world, so that one can die while the others go on): they are created
straight from the coordinator's store, as a fresh gloo group per generation.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.comm.group import CommGroup
from paratrain.fault_tolerance.group_env import GroupEnv
from paratrain.fault_tolerance.quorum import Quorum
from paratrain.mesh import Mesh

log = logging.getLogger(__name__)
WAIT_S = 60.0


class Participant:
    def __init__(self, env: GroupEnv, mesh: Mesh, heartbeat_timeout_s: float, timeout_s: float):
        self.group, self.mesh = env.group, mesh
        self.leader = mesh.global_rank == 0
        host, port = env.coordinator.rsplit(":", 1)
        self._address = (host, int(port))
        self.timeout = timedelta(seconds=timeout_s)
        self.store = self._client()
        self.beat_every_s = max(heartbeat_timeout_s / 10, 0.02)
        self.options = replace(mesh.control.options, timeout_s=timeout_s)
        self.next_round: int | None = None
        self.asked, self.asked_step = -1, -1  # the round asked for last, at that step
        self.incarnation = 0  # this launch of the group: the leader counts them in the store
        self._groups: dict[int, CommGroup] = {}
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    def _client(self) -> dist.TCPStore:
        host, port = self._address
        return dist.TCPStore(host, port, is_master=False, timeout=self.timeout)

    # -- heartbeat -----------------------------------------------------------------------
    def _beat(self) -> None:
        store = self._client()  # its own connection: the main thread may be blocked in a wait
        while not self._stop.wait(self.beat_every_s):
            store.add(f"hb/{self.group}", 1)

    def start_beating(self) -> None:
        if self.leader and self._beats is None:
            self.store.add(f"hb/{self.group}", 1)
            self._beats = threading.Thread(target=self._beat, name="ft-heartbeat", daemon=True)
            self._beats.start()

    def close(self) -> None:
        if self.leader:
            self.store.set(f"left/{self.group}", "1")
        self._stop.set()
        if self._beats is not None:
            self._beats.join()

    # -- rounds --------------------------------------------------------------------------
    def ask(self, step: int) -> None:
        """Ask for the next round at `step` (the leader; the others have nothing to do)."""
        if not self.leader:
            return
        self.start_beating()
        r = self.next_round
        if r is None:  # joining: where the coordinator is now, as a new incarnation
            self.incarnation = self.store.add(f"inc/{self.group}", 1)
            r = int(self.store.get("round"))
        self._ask(r, step)

    def _ask(self, r: int, step: int) -> None:
        self.store.set(f"ask/{r}/{self.group}", f"{step} {self.incarnation}")
        self.asked, self.asked_step, self.next_round = r, step, r + 1

    def decision(self) -> Quorum:
        """The decision of the round asked for last (collective over the group: the leader
        waits for it, everyone learns it)."""
        answer = None
        if self.leader:
            answer = self._answer()
        return Quorum.from_json(comm.broadcast_object(answer, self.mesh.control))

    def _answer(self) -> str:
        """The leader's wait for the round asked for. A group relaunched faster than the
        coordinator saw it die may find a round decided on its last incarnation's ask (which
        fails: that incarnation never votes): it asks again in the next round."""
        while True:
            self._wait(f"quorum/{self.asked}")
            answer = self.store.get(f"quorum/{self.asked}").decode()
            if Quorum.from_json(answer).asked_by(self.group, self.incarnation):
                return answer
            log.warning("replica group %d: round %d was decided for the group before its "
                        "relaunch; asking in the next", self.group, self.asked)  # fmt: skip
            self._ask(self.asked + 1, self.asked_step)

    def _wait(self, key: str) -> None:
        """Until the key is set (`store.wait` returns at once then), or the coordinator's
        error. In waits of WAIT_S, long ones: torch logs two warnings for every wait that
        times out, and a round is that slow to come only while a group is waited for."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=WAIT_S))
            except dist.DistStoreError:  # timed out: the coordinator may have failed
                pass
            if self.store.check(["quorum/error"]):
                error = self.store.get("quorum/error").decode()
                raise RuntimeError(f"the fault-tolerance coordinator failed: {error}")
            if self.store.check([key]):
                return

    def first_time(self, key: str) -> bool:
        """True the first time any incarnation of this group asks about `key` (collective
        over the group): an injected fault fires once, also across relaunches."""
        first = self.store.add(f"once/{self.group}/{key}", 1) == 1 if self.leader else None
        return bool(comm.broadcast_object(first, self.mesh.control))

    def vote(self, quorum: Quorum, ok: bool) -> bool:
        """Say whether this group's round succeeded (every rank of it); True when the
        coordinator committed the round: every participant succeeded."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device="cpu")  # control: gloo
        comm.all_reduce(flag, self.mesh.control, op="min")
        committed = None
        if self.leader:
            self.store.set(f"vote/{quorum.round}/{self.group}", str(int(flag.item())))
            self._wait(f"commit/{quorum.round}")
            committed = self.store.get(f"commit/{quorum.round}") == b"1"
        return bool(comm.broadcast_object(committed, self.mesh.control))

    def across(self, quorum: Quorum) -> CommGroup:
        """This rank and its peers at the same position in the quorum's other groups."""
        if quorum.generation not in self._groups:
            self._groups.clear()  # one generation at a time: the old one may hold a dead peer
            prefix = f"pg/{quorum.generation}/{self.mesh.global_rank}"
            store = dist.PrefixStore(prefix, self._client())
            me = quorum.participants.index(self.group)
            gloo = dist.ProcessGroupGloo(store, me, len(quorum.participants), self.timeout)
            # A gloo backend, which torch.distributed's calls take as a group (2.11-2.14)
            pg = cast(dist.ProcessGroup, gloo)
            self._groups[quorum.generation] = CommGroup(
                "replicas",
                pg,
                list(quorum.participants),
                self.group,
                self.mesh.ledger,
                self.options,
            )
        return self._groups[quorum.generation]
