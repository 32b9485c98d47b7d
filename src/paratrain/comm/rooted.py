"""Collectives around one root rank, and the small ones: scatter, gather, barrier, and a
broadcast of a picklable object. Sent as point-to-point messages from or to the root,
which is how gloo implements scatter and gather too; recorded like every other call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm import ordering
from paratrain.comm.call import begin, describe, finish
from paratrain.comm.group import CommGroup
from paratrain.comm.p2p import exchange
from paratrain.comm.traffic import Traffic
from paratrain.comm.wait import failure, wait_works


def scatter(
    output: torch.Tensor,
    group: CommGroup,
    src: int = 0,
    chunks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Group rank `src` sends chunks[r] to rank r, which receives it into `output`.

    Chunks may differ in size; each rank's `output` must match its own chunk. Sent as the
    root's k - 1 point-to-point messages, which is how gloo implements scatter too.
    """
    if group.rank == src and (chunks is None or len(chunks) != group.size):
        raise ValueError(f"scatter: the source must pass {group.size} chunks")
    if group.size == 1:
        return output.copy_(chunks[0])  # type: ignore[index]  # one rank, the source: checked above
    record = begin(group, "scatter", "native", describe(output))
    if group.rank == src:
        assert chunks is not None
        sends = [(c.reshape(-1), r) for r, c in enumerate(chunks) if r != src]
        traffic = exchange(group, record, sends, [])
        output.copy_(chunks[src])
    else:
        recv = output.new_empty(output.numel())
        traffic = exchange(group, record, [], [(recv, src)])
        output.copy_(recv.view_as(output))
    finish(group, record, traffic)
    return output


def gather(
    tensor: torch.Tensor,
    group: CommGroup,
    dst: int = 0,
    shapes: list[torch.Size] | None = None,
) -> list[torch.Tensor] | None:
    """Group rank `dst` receives every rank's tensor, in rank order; others get None.

    The destination may pass each rank's shape when they differ (default: all like its own).
    """
    if group.size == 1:
        return [tensor.clone()]
    record = begin(group, "gather", "native", describe(tensor))
    if group.rank != dst:
        traffic = exchange(group, record, [(tensor.reshape(-1), dst)], [])
        finish(group, record, traffic)
        return None
    shapes = shapes or [tensor.shape] * group.size
    outs = [tensor.new_empty(s) for s in shapes]
    recvs = [(o.view(-1), r) for r, o in enumerate(outs) if r != dst]
    traffic = exchange(group, record, [], recvs)
    outs[dst].copy_(tensor)
    finish(group, record, traffic)
    return outs


def barrier(group: CommGroup) -> None:
    """Return when every rank of the group has called barrier (bounded by the timeout)."""
    if group.size == 1:
        return
    record = begin(group, "barrier", "native", "-")
    start = lambda: dist.barrier(group=group.pg, async_op=True)  # noqa: E731
    wait_works(group, record, ordering.issue(group, record, start))
    finish(group, record, Traffic(0, 0, group.size - 1))


def broadcast_object(obj: Any, group: CommGroup, src: int = 0) -> Any:
    """Broadcast a small picklable object (a path, a config, an error) from rank `src`."""
    if group.size == 1:
        return obj
    record = begin(group, "broadcast_object", "native", type(obj).__name__)
    holder = [obj]
    root = group.to_global(src)
    try:  # blocking: under NCCL's order, on the collective stream's thread (ordering.py)
        works = ordering.issue(
            group, record, lambda: dist.broadcast_object_list(holder, src=root, group=group.pg)
        )
    except RuntimeError as e:
        raise failure(group, record, e) from e
    wait_works(group, record, works)
    finish(group, record, Traffic(0, 0, 0))  # pickled size is not known to us; not counted
    return holder[0]
