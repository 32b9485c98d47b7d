"""Bytes this process really put on the wire, from the kernel's per-socket TCP counters.

gloo over TCP sends with `sendmsg`, which the per-process write counters of /proc/self/io
do not see, and the comm ledger records native collectives from a formula. The kernel
keeps, per TCP socket, `struct tcp_info` (include/uapi/linux/tcp.h, read with
getsockopt(IPPROTO_TCP, TCP_INFO)); its RFC 4898 counters are what we read:

    tcpi_bytes_acked     payload bytes the peer acknowledged (no TCP/IP headers, no
                         retransmitted copies): what this process delivered
    tcpi_bytes_sent      payload bytes handed to IP, retransmissions included
    tcpi_bytes_retrans   of which retransmitted
    tcpi_data_segs_out   segments that carried payload (each has a TCP/IP header)

The offsets below are the kernel's ABI: fields are only ever appended to the struct, so
they hold on every kernel that has them (bytes_acked since 4.1, bytes_sent and
bytes_retrans since 4.19); a shorter answer from an older kernel raises. tests/test_wire.py
checks them against a known transfer over loopback.

Every TCP socket of the process is counted, found through /proc/self/fd. The caller names
the ports to leave out (a TCPStore's port: its client socket talks to the store, not to a
peer), and `settled_counters` waits until everything written is acknowledged, so that a reading
taken right after a collective includes its last bytes.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TCP_INFO_LEN = 232  # through tcpi_snd_wnd; the kernel answers min(asked, its size)
OFFSETS = {  # byte offset and struct format of each field read (native-endian)
    "state": (0, "B"),
    "unacked": (24, "I"),  # segments sent, not yet acknowledged
    "bytes_acked": (120, "Q"),
    "bytes_received": (128, "Q"),
    "notsent_bytes": (144, "I"),  # written by the process, not yet sent
    "data_segs_out": (156, "I"),
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
}
MIN_LEN = 216  # bytes_retrans ends here: a kernel answering less lacks the counters
LISTEN = 10  # TCP_LISTEN: a listening socket moves no bytes
IPV4_TCP_HEADER = 52  # IPv4 20 + TCP 20 + the timestamp option 12, per segment (Linux default)


@dataclass(frozen=True)
class TcpCounters:
    """One socket's counters at one moment, and its two ends."""

    local: tuple[str, int]
    peer: tuple[str, int]
    state: int
    unacked: int
    bytes_acked: int
    bytes_received: int
    notsent_bytes: int
    data_segs_out: int
    bytes_sent: int
    bytes_retrans: int


def parse_tcp_info(raw: bytes) -> dict[str, int]:
    """The fields of OFFSETS from getsockopt's answer; pure, so a test can feed it bytes."""
    if len(raw) < MIN_LEN:
        raise OSError(
            f"TCP_INFO answered {len(raw)} bytes; tcpi_bytes_sent and tcpi_bytes_retrans need "
            f"{MIN_LEN} (Linux 4.19 or later)"
        )
    return {name: struct.unpack_from(fmt, raw, off)[0] for name, (off, fmt) in OFFSETS.items()}


def read_socket(sock: socket.socket) -> TcpCounters:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    local, peer = sock.getsockname()[:2], _peer(sock)
    return TcpCounters(local=tuple(local), peer=peer, **parse_tcp_info(raw))


def _peer(sock: socket.socket) -> tuple[str, int]:
    try:
        return tuple(sock.getpeername()[:2])
    except OSError:  # listening or not yet connected
        return ("", 0)


def tcp_sockets(exclude_ports: Iterable[int] = ()) -> dict[int, TcpCounters]:
    """Every TCP socket of this process, by inode (stable while the socket lives, unlike
    a descriptor number), except listeners and those with an end on `exclude_ports`."""
    skip = set(exclude_ports)
    out: dict[int, TcpCounters] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread)
            continue
        if not link.startswith("socket:["):
            continue
        inode = int(link[len("socket:[") : -1])
        if inode in out:  # two descriptors of one socket
            continue
        try:  # a duplicate: closing it leaves the owner's descriptor open
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            try:
                c = read_socket(sock)
            except OSError:
                continue
        if c.state == LISTEN or c.local[1] in skip or c.peer[1] in skip:
            continue
        out[inode] = c
    return out


def settled_counters(
    exclude_ports: Iterable[int] = (), timeout_s: float = 10.0
) -> dict[int, TcpCounters]:
    """Wait until every byte written is sent and acknowledged; the counters then.

    A collective can return on this rank before the peer's ACK of its last segment is
    back (loopback acknowledges within microseconds, a delayed ACK within 40 ms).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        now = tcp_sockets(exclude_ports)
        if all(c.unacked == 0 and c.notsent_bytes == 0 for c in now.values()):
            return now
        if time.monotonic() > deadline:
            pending = {i: (c.unacked, c.notsent_bytes) for i, c in now.items() if c.unacked}
            raise TimeoutError(f"TCP sockets still unacknowledged after {timeout_s} s: {pending}")
        time.sleep(0.0005)


@dataclass(frozen=True)
class WireDelta:
    """What one socket sent between two readings."""

    local: tuple[str, int]
    peer: tuple[str, int]
    acked: int  # payload delivered to the peer
    sent: int  # payload sent, retransmissions included
    retrans: int
    received: int
    segments: int  # payload-carrying segments, each with a TCP/IP header

    @property
    def header_bytes(self) -> int:
        """TCP/IP header bytes these segments carried (IPv4 with timestamps; estimated)."""
        return self.segments * IPV4_TCP_HEADER


def deltas(
    before: Mapping[int, TcpCounters], after: Mapping[int, TcpCounters]
) -> dict[int, WireDelta]:
    """Per socket, the counters' growth. A socket opened in between counts from zero;
    one closed in between is lost (its last counters are gone with it)."""
    out = {}
    for inode, a in after.items():
        b = before.get(inode)
        d = WireDelta(
            a.local,
            a.peer,
            a.bytes_acked - (b.bytes_acked if b else 0),
            a.bytes_sent - (b.bytes_sent if b else 0),
            a.bytes_retrans - (b.bytes_retrans if b else 0),
            a.bytes_received - (b.bytes_received if b else 0),
            a.data_segs_out - (b.data_segs_out if b else 0),
        )
        if d.sent or d.received or d.acked:
            out[inode] = d
    return out


def total_acked(moved: Mapping[int, WireDelta], sockets: Iterable[int] | None = None) -> int:
    """Payload bytes delivered, over `sockets` (inodes) or all of them."""
    keep = set(moved) if sockets is None else set(sockets)
    return sum(d.acked for i, d in moved.items() if i in keep)


class WireMeter:
    """`with WireMeter() as w: collective()` then `w.moved` (per socket) and `w.acked`.

    Settles on entry and on exit, so the reading holds the region's bytes and only them,
    provided nothing else in this process sends meanwhile (another thread's traffic
    would be counted too: measure with the store and any watchdog idle, or exclude their
    ports).
    """

    def __init__(self, exclude_ports: Iterable[int] = (), timeout_s: float = 10.0) -> None:
        self.exclude_ports, self.timeout_s = tuple(exclude_ports), timeout_s
        self.moved: dict[int, WireDelta] = {}

    def __enter__(self) -> WireMeter:
        self._before = settled_counters(self.exclude_ports, self.timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.moved = deltas(self._before, settled_counters(self.exclude_ports, self.timeout_s))

    @property
    def acked(self) -> int:
        return total_acked(self.moved)

    @property
    def header_bytes(self) -> int:
        return sum(d.header_bytes for d in self.moved.values())


def store_ports(store: object) -> tuple[int, ...]:
    """The port of a TCPStore, under any PrefixStore wrapping it: its client sockets talk to
    the store, not to a peer. None for a FileStore (rendezvous through a file)."""
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    port = getattr(store, "port", None)
    return (port,) if isinstance(port, int) and port > 0 else ()
