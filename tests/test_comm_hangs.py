"""A collective that cannot complete fails within its timeout, with a report naming the first
divergence between the ranks' ledgers, instead of hanging forever.

Each rank catches the CommError and returns its message and how long it took, so the test
can check every rank's report. The timeout is 3 s; each report must arrive within 3 + 5 s.
"""

from __future__ import annotations

import time

import torch

from paratrain import comm
from paratrain.comm.group import CommOptions
from paratrain.comm.watchdog import first_divergence
from paratrain.mesh import Mesh
from tests.distributed import run_distributed

TIMEOUT_S = 3.0
# A report takes the timeout, half a second for peers to publish and a few store reads;
# the rest of the bound is room for a machine whose CPUs other processes keep busy.
REPORTED_WITHIN_S = TIMEOUT_S + 12


def _good_calls(group, n):
    for _ in range(n):
        comm.all_reduce(torch.ones(4), group)


def _until_error(rank, body):
    mesh = Mesh.build(dp=4, options=CommOptions(timeout_s=TIMEOUT_S))
    group = mesh.group("dp")
    _good_calls(group, 4)
    start = time.monotonic()
    try:
        body(rank, group)
    except comm.CommError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def wrong_op(rank, world_size):
    def body(rank, group):
        if rank == 3:
            comm.all_gather_flat(torch.ones(4), group, sizes=[4] * 4)
        else:
            comm.all_reduce(torch.ones(4), group)

    return _until_error(rank, body)


def skipped_call(rank, world_size):
    def body(rank, group):
        if rank != 2:  # rank 2 skips call #5 and goes on to call #6
            comm.all_reduce(torch.ones(4), group)
        comm.all_reduce(torch.ones(8), group)

    return _until_error(rank, body)


def stuck_in_compute(rank, world_size):
    def body(rank, group):
        if rank == 1:
            time.sleep(TIMEOUT_S + 4)  # stuck outside communication, then gives up
            return
        comm.all_reduce(torch.ones(4), group)

    return _until_error(rank, body)


def test_different_op_at_the_same_call_is_named():
    results = run_distributed(wrong_op, 4)
    for message, elapsed in results:
        assert message is not None and elapsed < REPORTED_WITHIN_S
        assert "first divergence in group 'dp' [0, 1, 2, 3] at call #5" in message
        assert "ranks [0, 1, 2] called all_reduce(native) float32[4]" in message
        assert "ranks [3] called all_gather(native) float32[4]" in message


def test_a_skipped_call_is_named():
    results = run_distributed(skipped_call, 4)
    reports = [m for m, _ in results if m is not None]
    assert reports, "no rank reported the hang"
    for message, elapsed in results:
        if message is not None:
            assert elapsed < REPORTED_WITHIN_S
            assert "at call #5" in message
            assert "ranks [0, 1, 3] called all_reduce(native) float32[4]" in message
            assert "ranks [2] called all_reduce(native) float32[8]" in message


def test_a_rank_stuck_outside_communication_is_named():
    results = run_distributed(stuck_in_compute, 4)
    for rank, (message, elapsed) in enumerate(results):
        if rank == 1:
            continue
        assert message is not None and elapsed < REPORTED_WITHIN_S
        assert f"rank {rank} (rank {rank} of group 'dp'" in message
        assert "at call #5" in message and "ranks [0, 2, 3] called all_reduce" in message
        assert (
            "rank 1 did not make this call (not in any collective; last completed call #4"
            in message
        )


def checked_mismatch(rank, world_size):
    mesh = Mesh.build(dp=2, options=CommOptions(timeout_s=TIMEOUT_S, check=True))
    group = mesh.group("dp")
    comm.all_reduce(torch.ones(4), group)
    try:
        comm.all_reduce(torch.ones(4 if rank == 0 else 5), group)
    except comm.CommError as e:
        return str(e)
    return None


def test_per_call_checking_refuses_mismatched_shapes_at_once():
    start = time.monotonic()
    messages = run_distributed(checked_mismatch, 2)
    assert time.monotonic() - start < REPORTED_WITHIN_S
    for message in messages:
        assert "disagree on the next call" in message
        assert "ranks [0]: #2 all_reduce(native) float32[4]" in message
        assert "ranks [1]: #2 all_reduce(native) float32[5]" in message


def test_first_divergence_is_pure():
    def ledger(*calls):
        recent = [
            {
                "seq": i + 1,
                "op": op,
                "algo": "native",
                "shapes": shape,
                "group": "dp",
                "ranks": [0, 1],
                "start": 0.0,
                "end": 1.0,
            }
            for i, (op, shape) in enumerate(calls)
        ]
        return {"recent": recent, "published_at": time.time(), "perf_now": 2.0}

    same = first_divergence(
        "dp",
        [0, 1],
        {0: ledger(("all_reduce", "float32[4]")), 1: ledger(("all_reduce", "float32[4]"))},
    )
    assert same.startswith("no divergence")
    differ = first_divergence(
        "dp",
        [0, 1],
        {
            0: ledger(("all_reduce", "f[1]"), ("broadcast", "f[2]")),
            1: ledger(("all_reduce", "f[1]"), ("broadcast", "f[3]")),
        },
    )
    assert "at call #2" in differ and "f[2]" in differ and "f[3]" in differ
    silent = first_divergence("dp", [0, 1], {0: ledger(("all_reduce", "f[1]")), 1: None})
    assert "ranks [1] published no ledger" in silent


def hung_peer(rank, world_size):
    mesh = Mesh.build(dp=2, options=CommOptions(timeout_s=TIMEOUT_S))
    mesh.ledger.step = 7  # as the training loop sets it
    start = time.monotonic()
    try:
        if rank == 0:
            comm.recv(torch.empty(4), mesh.group("dp"), src=1)
        else:
            time.sleep(TIMEOUT_S + 4)  # never sends
    except comm.CommError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_point_to_point_wait_names_its_peer_and_the_training_step():
    message, elapsed = run_distributed(hung_peer, 2)[0]
    assert message is not None and elapsed < REPORTED_WITHIN_S
    assert "recv(native) with peer rank 1 call #1 float32[4] in training step 7" in message


class _DeviceWorkThatNeverCompletes:
    """NCCL's work as the host sees it: `wait` would return at once (it only makes the CUDA
    stream wait), so the host must poll `is_completed` to notice a hung peer."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        raise AssertionError("reached wait() before the work completed: nothing was polled")


def test_a_hung_collective_on_an_asynchronous_backend_is_reported_within_the_timeout():
    from paratrain.comm.group import CommGroup
    from paratrain.comm.ledger import Ledger
    from paratrain.comm.wait import CommError, wait_works

    ledger = Ledger()
    group = CommGroup("dp", None, [3, 5], 5, ledger, CommOptions(timeout_s=0.3))
    group.asynchronous_to_host = True  # as an NCCL group (no GPU here to make one)
    record = ledger.start("all_reduce", "dp", (3, 5), "native", "float32[4]")
    start = time.perf_counter()
    try:
        wait_works(group, record, [_DeviceWorkThatNeverCompletes()])
    except CommError as e:
        message = str(e)
    else:
        raise AssertionError("no error")
    assert time.perf_counter() - start < 0.3 + 2.0
    assert message.startswith("rank 5 (rank 1 of group 'dp', ranks [3, 5]): all_reduce(native)")
    assert "timed out after 0.3 s" in message
