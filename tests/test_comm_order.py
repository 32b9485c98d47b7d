"""NCCL's ordering on gloo (comm/ordering.py): programs that deadlock on NCCL deadlock here
too, under `CommOptions(order="nccl")`, and are reported; without the order they pass.

Each deadlock case runs in three modes: "nccl" (the order: a CommError names the rank,
the stream and the calls queued on it), "gloo" (no order: gloo's buffering lets it pass)
and "unordered" (the order asked for, but each stream's calls run at once, each on a
thread of its own, instead of one after the other: the mutation that shows the deadlock
comes from the order, not from the streams' threads or the handles). The timeout is 3 s;
each report must arrive within 3 + 12 s, as in test_comm_hangs.py.

A test asks for the order with `Mesh.build(..., options=CommOptions(order="nccl"))`.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from paratrain import comm
from paratrain.comm import p2p, streams
from paratrain.comm.group import CommOptions
from paratrain.mesh import Mesh
from tests.distributed import run_distributed

TIMEOUT_S = 3.0
REPORTED_WITHIN_S = TIMEOUT_S + 12


def _run_at_once(self, label, run, blocked_on):
    """Stream.submit without the order: the call starts now, on a thread of its own."""
    work = streams.StreamWork(self, label, blocked_on)
    threading.Thread(target=work.execute, args=(run,), daemon=True).start()
    return work


def _group(mode: str, **options):
    if mode == "unordered":
        streams.Stream.submit = _run_at_once  # this rank's process only
    order = "gloo" if mode == "gloo" else "nccl"
    mesh = Mesh.build(dp=2, options=CommOptions(timeout_s=TIMEOUT_S, order=order, **options))
    group = mesh.group("dp")
    comm.all_reduce(torch.ones(1), group)  # call #1: every connection is up
    return group


def _until_error(rank, world_size, mode, body):
    group = _group(mode)
    start = time.monotonic()
    try:
        result = body(rank, group)
    except comm.CommError as e:
        return "error", str(e), time.monotonic() - start
    return "ok", result, time.monotonic() - start


def recv_then_send(rank, group):
    """(a) Both ranks post a receive, then a send, unbatched, and wait for the send."""
    peer = 1 - rank
    got = torch.empty(4)
    r = comm.irecv(got, group, src=peer)  # call #2
    s = comm.isend(torch.full((4,), float(rank)), group, dst=peer)  # call #3
    s.wait()
    r.wait()
    return got.tolist()


def pipeline_receives_ahead(rank, group):
    """(b) 1F1B, 2 stages, 4 micro-batches; the last stage posts the receive of the next
    forward's activation before it sends the gradient of the last backward."""
    acts = [torch.full((2,), 10.0 + i) for i in range(4)]
    grads = [torch.full((2,), 20.0 + i) for i in range(4)]
    if rank == 0:
        sends = [comm.isend(acts[0], group, dst=1), comm.isend(acts[1], group, dst=1)]
        got = [comm.recv(torch.empty(2), group, src=1)]  # grad 0 before act 2
        sends.append(comm.isend(acts[2], group, dst=1))
        got.append(comm.recv(torch.empty(2), group, src=1))
        sends.append(comm.isend(acts[3], group, dst=1))
        got += [comm.recv(torch.empty(2), group, src=1) for _ in range(2)]
        for s in sends:
            s.wait()
        return [g.tolist() for g in got]
    bufs = [torch.empty(2) for _ in range(4)]
    recvs = [comm.irecv(bufs[0], group, src=0), comm.irecv(bufs[1], group, src=0)]  # #2, #3
    recvs[0].wait()  # forward 0
    recvs.append(comm.irecv(bufs[2], group, src=0))  # #4: ahead, for forward 2
    comm.isend(grads[0], group, dst=0).wait()  # #5: backward 0; blocked under NCCL
    recvs[1].wait()  # forward 1
    recvs.append(comm.irecv(bufs[3], group, src=0))
    comm.isend(grads[1], group, dst=0).wait()
    recvs[2].wait()
    comm.isend(grads[2], group, dst=0).wait()
    recvs[3].wait()
    comm.isend(grads[3], group, dst=0).wait()
    return [b.tolist() for b in bufs]


def batch_then_collective(rank, group):
    """(c) Rank 0 sends in a batch (on the collectives' stream), then all-reduces; rank 1
    all-reduces, then receives the batch."""
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        _, (h,) = p2p.post(group, [(torch.arange(4.0), 1)], [])  # #2
        comm.all_reduce(t, group)  # #3: behind the batch on the same stream
        h.wait()
        return t.tolist()
    comm.all_reduce(t, group)  # #2
    got = torch.empty(4)
    (h,), _ = p2p.post(group, [], [(got, 0)])
    h.wait()
    return t.tolist() + got.tolist()


def send_then_collective(rank, group):
    """(c) The same with an unbatched, blocking send: the send waits for its receive."""
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        comm.send(torch.arange(4.0), group, dst=1)  # #2
        comm.all_reduce(t, group)
        return t.tolist()
    comm.all_reduce(t, group)  # #2
    return t.tolist() + comm.recv(torch.empty(4), group, src=0).tolist()


def isend_then_collective(rank, group):
    """Not a deadlock on NCCL: the unbatched send runs on its pair's stream, the all-reduce
    on the collectives', so neither waits for the other."""
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        h = comm.isend(torch.arange(4.0), group, dst=1)
        comm.all_reduce(t, group)
        h.wait()
        return t.tolist()
    comm.all_reduce(t, group)
    return t.tolist() + comm.recv(torch.empty(4), group, src=0).tolist()


def _reports(body, mode):
    results = run_distributed(_until_error, 2, mode, body)
    for status, _, elapsed in results:
        assert status == "error" and elapsed < REPORTED_WITHIN_S, results
    return [message for _, message, _ in results]


def _completes(body, mode):
    results = run_distributed(_until_error, 2, mode, body)
    assert all(status == "ok" for status, _, _ in results), results
    return [result for _, result, _ in results]


def test_both_ranks_receiving_first_deadlock_under_nccl_order():
    zero, one = _reports(recv_then_send, "nccl")
    assert zero.startswith("rank 0 (rank 0 of group 'dp', ranks [0, 1]): send(native)")
    assert "stream 'pair 0:1 of world/dp' (unbatched send/recv between ranks 0 and 1" in zero
    assert "1 call(s) queued ahead of send #3 float32[4] to rank 1:" in zero
    assert "recv #2 float32[4] from rank 1: running for" in zero
    assert "no matching send from rank 1 yet" in zero
    assert "send #3 float32[4] to rank 1: queued  <- waited for" in zero
    assert "1 call(s) queued ahead of send #3 float32[4] to rank 0:" in one
    assert "no divergence in the recorded calls of group 'dp'" in zero  # the watchdog's


def test_pipeline_receive_posted_ahead_deadlocks_under_nccl_order():
    zero, one = _reports(pipeline_receives_ahead, "nccl")
    assert "0 call(s) queued ahead of recv #4 float32[2] from rank 1" in zero
    assert one.startswith("rank 1 (rank 1 of group 'dp', ranks [0, 1]): send(native)")
    assert "stream 'pair 0:1 of world/dp'" in one
    assert "1 call(s) queued ahead of send #5 float32[2] to rank 0:" in one
    assert "recv #4 float32[2] from rank 0: running for" in one


def test_a_batch_ahead_of_a_collective_deadlocks_under_nccl_order():
    zero, one = _reports(batch_then_collective, "nccl")
    assert (
        "stream 'collectives of world/dp' (group 'world/dp' [0, 1]: its collectives and batched"
        in zero
    )
    assert "1 call(s) queued ahead of all_reduce #3 float32[4]:" in zero
    assert "send #2 float32[4]: running for" in zero
    assert "its parts not all matched by ranks [1]" in zero
    assert "0 call(s) queued ahead of all_reduce #2 float32[4]" in one


def test_a_blocking_send_before_a_collective_deadlocks_under_nccl_order():
    zero, one = _reports(send_then_collective, "nccl")
    assert "send #2 float32[4] to rank 1: running for" in zero
    assert "no matching receive from rank 1 yet" in zero
    assert "0 call(s) queued ahead of all_reduce #2 float32[4]" in one


def test_gloo_itself_holds_a_send_until_its_receive_is_posted():
    """What the order relies on to make sends block until matched (ordering.py): gloo's
    TCP transport is a rendezvous, not a buffer. Should a transport start buffering, this
    fails, and sends need an acknowledgement from their receiver."""
    zero, _ = _reports(send_then_collective, "gloo")
    assert "send(native) with peer rank 1 call #2 float32[4]" in zero


DEADLOCKS = [recv_then_send, pipeline_receives_ahead, batch_then_collective]


@pytest.mark.parametrize("body", DEADLOCKS, ids=lambda f: f.__name__)
def test_without_the_order_the_deadlocks_complete(body):
    plain = _completes(body, "gloo")
    if body is recv_then_send:
        assert plain == [[1.0] * 4, [0.0] * 4]
    if body is pipeline_receives_ahead:
        assert plain == [[[20.0 + i] * 2 for i in range(4)], [[10.0 + i] * 2 for i in range(4)]]


@pytest.mark.parametrize("body", DEADLOCKS, ids=lambda f: f.__name__)
def test_the_deadlocks_come_from_the_order(body):
    """The mutation: the same options, each stream's calls run at once; all complete."""
    _completes(body, "unordered")


def test_separate_streams_let_an_unbatched_send_pass_a_collective():
    assert _completes(isend_then_collective, "nccl") == _completes(isend_then_collective, "gloo")


def batch_both_ways(rank, world_size, order):
    group = _group(order)
    peer = 1 - rank
    got = torch.empty(3)
    (received,), (sent,) = p2p.post(group, [(torch.full((3,), float(rank)), peer)], [(got, peer)])
    received.wait(), sent.wait()
    return got.tolist()


def test_a_batch_sending_and_receiving_both_ways_completes_under_nccl_order():
    assert run_distributed(batch_both_ways, 2, "nccl") == [[1.0] * 3, [0.0] * 3]


def receive_from_any(rank, world_size):
    group = _group("nccl")
    start = time.monotonic()
    try:
        comm.recv_any(torch.empty(1), group)
    except ValueError as e:
        return str(e), time.monotonic() - start
    return None, 0.0


def test_receive_from_any_fails_at_once_under_nccl_order():
    for message, elapsed in run_distributed(receive_from_any, 2):
        assert message is not None and elapsed < 1.0
        assert len(message.splitlines()) == 1 and message.startswith("recv_any")
        assert "NCCL has none" in message


def collectives(rank, world_size, order, check, default_algo):
    options = CommOptions(order=order, check=check, algo=default_algo)
    mesh = Mesh.build(dp=world_size, options=options)
    group = mesh.group("dp")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(13, generator=g)
    out = []
    for algo in ("native", "ring", "tree"):
        out.append(comm.all_reduce(x.clone(), group, algo=algo))
        out.append(comm.all_reduce(x.clone(), group, algo=algo, async_op=True).wait())
        out.append(comm.broadcast(x.clone(), group, src=1, algo=algo if algo != "ring" else None))
    for algo in ("native", "ring"):
        out += comm.all_gather(x[: 3 + (0 if check else rank)], group, algo=algo)
        out.append(comm.reduce_scatter(x, group, algo=algo))
        out.append(comm.reduce_scatter(x[:12], group, algo=algo, async_op=True).wait())
        sizes = [4] * world_size
        out.append(comm.all_gather_flat(x[:4], group, algo, sizes, async_op=True).wait())
    out.append(comm.reduce(x.clone(), group, dst=0, algo="tree"))
    rows = torch.randn(2 * world_size, 3, generator=g)
    for algo in ("native", "pairwise"):
        out.append(comm.all_to_all(rows, group, algo=algo))
    out.append(comm.gather(x, group, dst=0) or [])
    comm.barrier(group)
    out.append(torch.tensor(comm.broadcast_object(rank + 10, group, src=1)))
    # The run-wide default (CommOptions(algo=...)), in flight together as DP buckets are.
    handles = [comm.all_reduce(x * i, group, async_op=True) for i in range(3)]
    handles.append(comm.reduce_scatter(x[:12], group, async_op=True))
    out += [h.wait() for h in handles]
    out.append(comm.all_gather_flat(x[:4], group, sizes=[4] * world_size))
    return out


@pytest.mark.parametrize(
    "check, default_algo",
    [(False, "native"), (True, "native"), (False, "ring"), (False, "tree")],
    ids=["plain", "checked", "ring-default", "tree-default"],
)
def test_collectives_are_bitwise_the_same_under_nccl_order(check, default_algo):
    """Exact: the same gloo calls and our algorithms' same steps, only waited in turn."""
    args = (check, default_algo)
    plain = run_distributed(collectives, 3, "gloo", *args)
    ordered = run_distributed(collectives, 3, "nccl", *args)
    for mine, theirs in zip(plain, ordered, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            if isinstance(a, list):
                assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
            else:
                assert torch.equal(a, b)


def shared_streams(rank, world_size):
    mesh = Mesh.build(dp=2, options=CommOptions(order="nccl"))
    return mesh.group("dp").streams is mesh.group("world").streams, mesh.control._streams


def test_groups_over_one_process_group_share_their_streams():
    """As on NCCL, one stream per communicator: "dp" over the whole world is the world's
    process group. The control group stays in gloo's order (it is gloo on GPUs too)."""
    for shared, control in run_distributed(shared_streams, 2):
        assert shared and control is None


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="comm order 'mpi'; valid: gloo, nccl"):
        CommOptions(order="mpi")
