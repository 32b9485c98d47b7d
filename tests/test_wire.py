"""Bytes on the wire (measure/tcp_bytes.py): the kernel's TCP counters, checked against a known
transfer, then around native gloo collectives between 2 real processes.

The known transfer is asymmetric (N one way, M the other), so reading the wrong field of
struct tcp_info (bytes_received for bytes_acked, a stale offset) cannot pass. The
collective tests compare with the ring formula 2 (k-1)/k S plus gloo's preambles, and
with numbers the ledger cannot produce (the ledger records the formula itself), so they
fail when the wire measurement is broken even though the ledger is not.
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from paratrain import comm
from paratrain.bench.comm.wire import binomial_children, gloo_model
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import Ledger
from paratrain.measure import tcp_bytes as wire
from tests.distributed import run_distributed

S = 4 << 20  # a native all-reduce of a few MB
PREAMBLES_MAX = 2048  # gloo's 48-byte preambles per call at k = 2 (576 measured)


def _loopback_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def _send_all(src: socket.socket, dst: socket.socket, n: int) -> None:
    def drain() -> None:
        got = 0
        while got < n:
            got += len(dst.recv(1 << 20))

    reader = threading.Thread(target=drain)
    reader.start()
    src.sendall(b"x" * n)
    reader.join()


def test_offsets_against_a_known_transfer():
    server, client, accepted = _loopback_pair()
    with server, client, accepted:
        ends = client.getsockname(), accepted.getsockname()
        before = wire.settled_counters()
        _send_all(client, accepted, 3_000_001)  # several 64 KB segments
        _send_all(accepted, client, 1234)
        moved = wire.deltas(before, wire.settled_counters())
    by_local = {d.local: d for d in moved.values()}
    out, back = by_local[ends[0]], by_local[ends[1]]
    # bytes_sent counts retransmitted copies too: on a loaded machine loopback TCP does
    # retransmit (14,875 bytes once in CI), so what is exact is sent = delivered + retrans.
    assert (out.acked, out.sent - out.retrans, out.received) == (3_000_001, 3_000_001, 1234)
    assert (back.acked, back.sent - back.retrans, back.received) == (1234, 1234, 3_000_001)
    assert out.segments >= 3_000_001 // 65536  # loopback segments are at most 64 KB
    assert out.peer == ends[1]


def test_excluded_ports_and_short_answers():
    server, client, accepted = _loopback_pair()
    with server, client, accepted:
        port = server.getsockname()[1]  # as a TCPStore's port
        assert not any(port in (c.local[1], c.peer[1]) for c in wire.tcp_sockets((port,)).values())
        assert any(c.peer[1] == port for c in wire.tcp_sockets().values())
    with pytest.raises(OSError, match="Linux 4.19"):
        wire.parse_tcp_info(bytes(104))
    raw = bytearray(wire.TCP_INFO_LEN)
    struct.pack_into("Q", raw, 120, 77)  # tcpi_bytes_acked
    struct.pack_into("Q", raw, 200, 78)  # tcpi_bytes_sent
    fields = wire.parse_tcp_info(bytes(raw))
    assert (fields["bytes_acked"], fields["bytes_sent"], fields["bytes_received"]) == (77, 78, 0)


def _native_on_the_wire(rank: int, world: int, op: str, nbytes: int) -> dict:
    ledger = Ledger()
    group = CommGroup.world(ledger)
    x = torch.ones(nbytes // 4)
    comm.barrier(group)
    ledger.reset()
    with wire.WireMeter() as meter:  # a FileStore: no store socket to exclude
        if op == "all_reduce":
            comm.all_reduce(x, group)
        else:
            comm.reduce_scatter(x, group)
    return {"ledger": ledger.totals()[("world", op)].bytes_sent, "wire": meter.acked}


def test_native_all_reduce_on_the_wire_is_the_ring_plus_preambles():
    """2 ranks, S = 4 MB: each sends 2 (k-1)/k S = S payload plus gloo's preambles, at
    least one and at most PREAMBLES_MAX bytes. The ledger says S exactly: it is the formula."""
    k = 2
    for r in run_distributed(_native_on_the_wire, k, "all_reduce", S):
        assert r["ledger"] == 2 * (k - 1) * S // k
        extra = r["wire"] - 2 * (k - 1) * S // k
        assert 48 <= extra <= PREAMBLES_MAX, r


def test_native_reduce_scatter_sends_twice_what_the_ledger_records():
    """gloo all-reduces and keeps a chunk: the wire shows 2 (k-1)/k S where the ledger
    (and the planner) count the ring's (k-1)/k S."""
    k = 2
    for r in run_distributed(_native_on_the_wire, k, "reduce_scatter", S):
        assert r["ledger"] == (k - 1) * S // k
        assert 0 <= r["wire"] - 2 * r["ledger"] <= PREAMBLES_MAX, r


def test_gloo_models():
    assert [binomial_children(r, 4) for r in range(4)] == [2, 1, 0, 0]
    assert [binomial_children(r, 3) for r in range(3)] == [2, 0, 0]
    assert gloo_model("broadcast", "native", 100, 4) == [200, 100, 0, 0]
    assert gloo_model("reduce_scatter", "native", 400, 4) == [600] * 4  # 2 (k-1)/k S
    assert gloo_model("reduce", "native", 400, 4) is None


def per_step_on_the_wire(rank: int, world: int, cfg, op: str | None = None) -> tuple:
    """(bytes delivered on the wire, the ledger's bytes of `op`, every op's by default)
    per training step, this rank: the difference between a run of 3 steps and one of 1,
    so that set-up and the end of the run cancel out (run_distributed's function)."""
    import dataclasses

    from paratrain.comm.group import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train
    from tests.equivalence import tiny_data

    options = CommOptions(order=cfg.parallel.comm_order)
    mesh = Mesh.build(dp=world, replicas=cfg.parallel.replicas, options=options)
    acked, ledger = [], []
    for steps in (1, 3):
        run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        mesh.ledger.reset()
        with wire.WireMeter() as meter:  # a FileStore: no store socket to leave out
            train(run, mesh, tiny_data())
        acked.append(meter.acked)
        ledger.append(mesh.ledger.bytes_sent(op=op) if op else mesh.ledger.bytes_sent())
    mesh.close()
    return (acked[1] - acked[0]) / 2, (ledger[1] - ledger[0]) / 2


def _uneven_reduce_scatter(rank: int, world: int, n: int) -> dict:
    from paratrain.simulate.memory import LiveStorages

    ledger = Ledger()
    group = CommGroup.world(ledger)
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    before = x.clone()
    comm.barrier(group)
    ledger.reset()
    with wire.WireMeter() as meter, LiveStorages() as memory:
        mine = comm.reduce_scatter(x, group, sizes=[n, 0])  # all of it rank 0's
        memory.mark()
    return {
        "wire": meter.acked,
        "ledger": ledger.totals()[("world", "reduce_scatter")].bytes_sent,
        "made": memory.steps[-1]["peak"],
        "right": torch.equal(mine, torch.arange(n, dtype=torch.float32) * 3)
        if rank == 0
        else mine.numel() == 0,  # fmt: skip
        "untouched": torch.equal(x, before),
    }


def test_an_uneven_reduce_scatter_goes_to_its_owner_not_padded_to_every_rank():
    """A bucket that lies in one rank's shard (ZeRO-1/2's buckets at large dp): one reduce
    to its owner. Padded to equal pieces for gloo's reduce-scatter, it was k times the
    bucket, in memory and on the wire (64 times at llama3-405b's dp 64:
    docs/planner.md); here at k = 2 the padded call sent 2 S from the owner and made 5 S
    of storages on each rank (tried). The ledger says S from rank 1, nothing from the
    owner, as before: a reduce sends what the ring's formula counts."""
    k, n = 2, S // 4
    results = run_distributed(_uneven_reduce_scatter, k, n)
    for rank, r in enumerate(results):
        assert r["right"] and r["untouched"], r
        assert r["ledger"] == (0 if rank == 0 else S), r
        assert r["wire"] <= S + PREAMBLES_MAX, r
        assert r["made"] <= 2 * S, r  # our scratch copy of the piece, and gloo's
