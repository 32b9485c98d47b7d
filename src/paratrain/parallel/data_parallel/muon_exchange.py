"""How Muon's matrices reach their owners and the results come back, for matrices held
whole by a data-parallel replica but split over tensor parallelism (WholeMuon, muon.py).

Owners are numbered o = d tp + t over the replica's dp ranks d and tp ranks t
(plan/muon.py `owners_of` over dp x tp ranks), so the work spreads over both. Matrix i,
split along `dims[i]` into tp shards, travels three times:
1. `gather_to_owners`: within each replica (tp group), every tp rank sends its shard of
   the update of each matrix its replica owns to the owning tp rank (float32 all-to-all);
2. `scatter_from_owners`: the owner sends every tp rank its shard of the orthogonalized
   matrix (an all-to-all of the Newton-Schulz precision's bytes);
3. `gather_over_replicas`: the replicas' shards are all-gathered over dp, so every rank
   has its shard of every result.
"""

from __future__ import annotations

import torch

from paratrain import comm


def whole_shapes(shapes: list[tuple[int, ...]], dims: list[int], tp: int) -> list[tuple[int, ...]]:
    """The whole matrices' shapes from their tp shards' (split along `dims`)."""
    return [
        tuple(n * (tp if d == dim else 1) for d, n in enumerate(shape))
        for shape, dim in zip(shapes, dims, strict=True)
    ]


def owner_of(owner: int, tp: int) -> tuple[int, int]:
    """(dp rank, tp rank) of owner number `owner`."""
    return divmod(owner, tp)


def gather_to_owners(
    updates: dict[int, torch.Tensor],
    owners: list[int],
    dims: list[int],
    dp_rank: int,
    tp: comm.CommGroup,
) -> dict[int, torch.Tensor]:
    """The whole update of each matrix this rank owns, from the tp ranks' shards.

    updates: this rank's shard of each matrix its replica owns (any tp rank), emptied once
    packed for sending (as `scatter_from_owners` does its results)."""
    k, me = tp.size, tp.rank
    ours = [i for i in sorted(updates) if owner_of(owners[i], k)[0] == dp_rank]
    to = [[i for i in ours if owner_of(owners[i], k)[1] == t] for t in range(k)]
    send = [updates[i].reshape(-1) for t in range(k) for i in to[t]]
    ins = [sum(updates[i].numel() for i in to[t]) for t in range(k)]
    mine = to[me]
    outs = [sum(updates[i].numel() for i in mine)] * k  # every shard is as large
    device = next(iter(updates.values())).device if updates else tp.device
    flat = torch.cat(send) if send else torch.empty(0, device=device)
    shapes = {i: updates[i].shape for i in mine}  # every tp rank's shard is as large
    send.clear()
    updates.clear()
    got = comm.all_to_all(flat, tp, ins, outs)
    del flat
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    offset = 0
    for _ in range(k):
        for i in mine:
            n = shapes[i].numel()
            pieces[i].append(got[offset : offset + n].view(shapes[i]))
            offset += n
    return {i: torch.cat(pieces[i], dim=dims[i]) for i in mine}


def scatter_from_owners(
    results: dict[int, torch.Tensor],
    shapes: dict[int, torch.Size],
    owners: list[int],
    dims: list[int],
    dp_rank: int,
    tp: comm.CommGroup,
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """This rank's shard (flat, `dtype`) of each result its replica owns.

    results: the whole results this rank computed (its own matrices), emptied once packed
    for sending, so that they do not sit beside the all-to-all's buffers; shapes: the local
    shard shape of every matrix its replica owns."""
    k, width = tp.size, dtype.itemsize
    send, ins = [], []
    for t in range(k):
        sent = 0
        for i in sorted(results):
            local = shapes[i][dims[i]]
            shard = results[i].narrow(dims[i], t * local, local).reshape(-1).to(dtype)
            send.append(shard.view(torch.uint8))
            sent += width * shard.numel()
        ins.append(sent)
    ours = sorted(shapes)
    by_owner = [[i for i in ours if owners[i] == dp_rank * k + t] for t in range(k)]
    outs = [width * sum(shapes[i].numel() for i in by_owner[t]) for t in range(k)]
    device = tp.device
    flat = torch.cat(send) if send else torch.empty(0, device=device, dtype=torch.uint8)
    send.clear()
    results.clear()
    got = comm.all_to_all(flat, tp, ins, outs)
    out, offset = {}, 0
    for t in range(k):
        for i in by_owner[t]:
            n = width * shapes[i].numel()
            out[i] = got[offset : offset + n].view(dtype)
            offset += n
    return out


def gather_over_replicas(
    shards: dict[int, torch.Tensor],
    numels: list[int],
    owners: list[int],
    stepped: list[int],
    tp: int,
    dp: comm.CommGroup,
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """This rank's shard of every stepped matrix's result: one all-gather over dp of each
    replica's shards (raw bytes), replica by replica. `shards` is emptied once packed, so
    that the buffer they view (the all-to-all's) is gone before the gathered one comes."""
    width = dtype.itemsize
    by_replica = [[i for i in stepped if owner_of(owners[i], tp)[0] == d] for d in range(dp.size)]
    if dp.size == 1:
        return shards
    sizes = [width * sum(numels[i] for i in ours) for ours in by_replica]
    own = by_replica[dp.rank]
    flat = (
        torch.cat([shards[i].view(torch.uint8) for i in own])
        if own
        else torch.empty(0, device=dp.device, dtype=torch.uint8)
    )
    shards.clear()
    gathered = comm.all_gather_flat(flat, dp, sizes=sizes)
    out, offset = {}, 0
    for ours in by_replica:
        for i in ours:
            n = width * numels[i]
            out[i] = gathered[offset : offset + n].view(dtype)
            offset += n
    return out
