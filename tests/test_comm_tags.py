"""Our algorithms' messages never mix with other point-to-point messages on the same
process group (comm/p2p.py `algorithm_tag`).

Groups as large as the world share its process group, and gloo matches point-to-point
messages by peer and tag alone: a ring all-reduce of dp_cp, running on that group's
thread, and context parallelism's messages, sent meanwhile from backward on the cp group,
once took each other's messages (`train --cp 2 --comm-algo ring` on 2 ranks died in
gloo at step 2). Here both run at once, with messages of other sizes than the ring's.
"""

from __future__ import annotations

import torch

from tests.distributed import run_distributed

ROUNDS = 12
SIZES = (1000, 3, 70_000)  # floats per message, none the ring's chunk


def ring_beside_messages(rank: int, world: int) -> list[tuple[float, list[float]]]:
    from paratrain import comm
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh

    mesh = Mesh.build(cp=world, options=CommOptions(algo="ring", order="gloo"))
    dp_cp, cp = mesh.group("dp_cp"), mesh.group("cp")
    assert dp_cp is not cp and dp_cp.pg is cp.pg  # two groups, one process group
    peer, out = 1 - rank, []
    for _ in range(ROUNDS):
        reduced = torch.full((2**18,), float(rank + 1))
        handle = comm.all_reduce(reduced, dp_cp, async_op=True)  # on dp_cp's thread
        received = []
        for n in SIZES:  # meanwhile, from this thread
            into = torch.empty(n)
            recv, send = comm.sendrecv(torch.full((n,), float(rank)), peer, into, peer, cp)
            received.append(float(recv.wait().sum()))
            send.wait()
        handle.wait()
        out.append((float(reduced.sum()), received))
    mesh.close()
    return out


def test_a_ring_and_messages_on_one_process_group_keep_apart():
    per_rank = run_distributed(ring_beside_messages, 2, order="gloo", timeout=300)
    for rank, rounds in enumerate(per_rank):
        peer = 1 - rank
        for reduced, received in rounds:
            assert reduced == 3.0 * 2**18  # 1 + 2 everywhere
            assert received == [float(peer * n) for n in SIZES]
