"""All-to-all: rank r's input is cut into k chunks along dimension 0, chunk p goes to rank p,
and rank r's output is the k chunks it received, in rank order.

What context parallelism's all-to-all (Ulysses) attention is built from: sequence-sharded
activations become head-sharded and back (Jacobs et al., arXiv:2309.14509). Chunks may
differ in size (`input_split_sizes`, `output_split_sizes`, in rows of dimension 0, as
`torch.distributed.all_to_all_single` takes them; gloo accepts uneven and empty chunks).

Two algorithms: `native`, the backend's own; `pairwise`, ours on point-to-point messages
(the pairwise exchange of Thakur, Rabenseifner & Gropp 2005, for long messages): at step
s = 1 .. k-1 rank r sends its chunk for (r + s) mod k and receives from (r - s) mod k, so
every rank sends and receives exactly one chunk per step and no link carries two. Both are
counted with `traffic.pairwise_all_to_all`: every chunk but its own, the least any
algorithm must move. The run-wide default (ring, tree) has no all-to-all: it runs native
unless the call names `pairwise`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from paratrain.comm import ordering
from paratrain.comm.call import Done, Handle, Pending, begin, describe, issued, run_ours
from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import CallRecord
from paratrain.comm.p2p import add, exchange
from paratrain.comm.traffic import Traffic, pairwise_all_to_all

ALGOS = ("native", "pairwise")


@overload
def all_to_all(
    tensor: torch.Tensor,
    group: CommGroup,
    input_split_sizes: list[int] | None = ...,
    output_split_sizes: list[int] | None = ...,
    algo: str | None = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_to_all(
    tensor: torch.Tensor,
    group: CommGroup,
    input_split_sizes: list[int] | None = ...,
    output_split_sizes: list[int] | None = ...,
    algo: str | None = ...,
    *,
    async_op: Literal[True],
) -> Pending: ...
def all_to_all(
    tensor: torch.Tensor,
    group: CommGroup,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
    algo: str | None = None,
    async_op: bool = False,
) -> torch.Tensor | Pending:
    """Send chunk p of `tensor` (along dimension 0) to group rank p; return what arrived.

    Without split sizes, dimension 0 is cut into k equal chunks (k must divide it) and the
    output has the input's shape. With them (both, since a rank cannot know what it will
    receive otherwise), the output has sum(output_split_sizes) rows. The input is not
    modified. async_op returns a Handle, in flight: the native call in the backend, the
    pairwise exchange on the group's communication thread.
    """
    chosen = _choose(algo)
    ins, outs = _splits(tensor, group, input_split_sizes, output_split_sizes)
    if group.size == 1:
        result = tensor.clone()
        return Done(result) if async_op else result
    inp = tensor.contiguous()
    out = tensor.new_empty((sum(outs), *tensor.shape[1:]))
    record = begin(group, "all_to_all", chosen, describe(tensor, out), overlapped=True)
    if chosen == "pairwise":
        run = lambda: _pairwise(inp, out, ins, outs, group, record)  # noqa: E731
        return run_ours(group, record, run, async_op, then=lambda: out)
    start = lambda: dist.all_to_all_single(out, inp, outs, ins, group=group.pg, async_op=True)  # noqa: E731
    works = ordering.issue(group, record, start)
    row = inp.shape[1:].numel() * inp.element_size()  # bytes per row of dimension 0
    traffic = pairwise_all_to_all([n * row for n in ins], [n * row for n in outs], group.rank)
    return issued(Handle(group, record, works, traffic, result=out), async_op)


def _choose(algo: str | None) -> str:
    chosen = algo or "native"
    if chosen not in ALGOS:
        raise ValueError(f"all_to_all has no {chosen!r} algorithm; valid: {', '.join(ALGOS)}")
    return chosen


def _splits(
    tensor: torch.Tensor, group: CommGroup, ins: list[int] | None, outs: list[int] | None
) -> tuple[list[int], list[int]]:
    """The chunk sizes in rows, checked: k numbers each, the input's adding up to its rows."""
    k = group.size
    if tensor.dim() == 0:
        raise ValueError("all_to_all needs a tensor with at least one dimension, got a scalar")
    rows = tensor.shape[0]
    if ins is None and outs is None:
        if rows % k:
            raise ValueError(
                f"all_to_all of {rows} rows over group {group.name} of {k} ranks: "
                f"{rows} is not divisible by {k}; pass the split sizes"
            )
        return [rows // k] * k, [rows // k] * k
    if ins is None or outs is None:
        raise ValueError("all_to_all needs both input_split_sizes and output_split_sizes")
    ins, outs = list(ins), list(outs)
    if len(ins) != k or len(outs) != k or min(ins + outs) < 0 or sum(ins) != rows:
        raise ValueError(
            f"all_to_all split sizes {ins} -> {outs} do not fit group {group.name} of {k} "
            f"ranks and an input of {rows} rows: {k} sizes >= 0 each, the input's adding "
            f"up to {rows}"
        )
    return ins, outs


def _pairwise(
    inp: torch.Tensor,
    out: torch.Tensor,
    ins: list[int],
    outs: list[int],
    group: CommGroup,
    record: CallRecord,
) -> Traffic:
    """The pairwise exchange, k - 1 steps of one message each way (module docstring)."""
    k, r = group.size, group.rank
    send_chunks, recv_chunks = inp.split(ins), out.split(outs)  # contiguous views along dim 0
    recv_chunks[r].copy_(send_chunks[r])
    traffic = Traffic(0, 0, 0)
    for step in range(1, k):
        dst, src = (r + step) % k, (r - step) % k
        # Both sides know the chunk sizes, so both skip the same empty messages (exchange).
        sent = exchange(group, record, [(send_chunks[dst], dst)], [(recv_chunks[src], src)])
        traffic = add(traffic, sent)
    return traffic
