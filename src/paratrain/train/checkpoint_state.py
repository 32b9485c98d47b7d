"""This rank's part of the training state, described as pieces of global tensors.

A sharded checkpoint must reload on any other mesh, so it cannot store "rank 3's flat
shard": it stores every parameter and every AdamW moment under the plain model's name
(`blocks.5.mlp.fc.weight`), with the global shape that name has in a single-process model,
and each rank contributes the boxes of it that it holds. Three layouts produce a rank's
part, and they compose:

- tensor parallelism splits a parameter along one dimension: the local tensor is one box
  of the global one, offset by tp_rank * local_size along that dimension;
- ZeRO / FSDP flatten the (tp-local) parameters into one buffer and give each dp rank a
  contiguous range of it: a flat range of a row-major tensor is a union of at most
  2 * ndim - 1 boxes (a partial row, whole rows, a partial row), each still contiguous;
- pipeline parallelism simply leaves other stages' names out.

DTensor says the same for even dim-0 shards (FSDP2); a flat range that cuts rows is not a
DTensor placement, hence these boxes, which torch.distributed.checkpoint stores as chunks
(`checkpoint_planner.py`). Every box's `data` is a view of live storage: saving reads the
training state without copying it, loading writes into it in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.tensor_parallel_state import sharded_parameters
from paratrain.parallel.zero import ZeroDataParallel
from paratrain.parallel.zero_flat import FlatShard

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state tensors, shaped like the parameter


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]  # where the box starts in the global tensor
    data: torch.Tensor  # a view of live storage, shaped like the box


@dataclass
class Sharded:
    """This rank's boxes of one global tensor (none of it, if `boxes` is empty)."""

    shape: torch.Size  # the global shape
    boxes: list[Box]


def flat_range_boxes(
    shape: tuple[int, ...], lo: int, hi: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Flattened elements [lo, hi) of a row-major `shape` as boxes (offsets, sizes, start).

    `start` is the box's first flat index: the box's elements are flat [start, start +
    prod(sizes)) in order, so a box is a contiguous slice of the flat tensor reshaped.
    """
    if lo >= hi:
        return []
    if not shape:  # a scalar
        return [((), (), 0)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, hi // inner  # rows [first, last), then part of row `last`

    def within(row: int, a: int, b: int) -> list:
        sub = flat_range_boxes(shape[1:], a, b)
        return [((row, *o), (1, *s), row * inner + st) for o, s, st in sub]

    if first == last:
        return within(first, lo - first * inner, hi - first * inner)
    boxes, row = [], first
    if lo % inner:
        boxes += within(row, lo % inner, inner)
        row += 1
    if last > row:
        boxes.append(((row, *[0] * (len(shape) - 1)), (last - row, *shape[1:]), row * inner))
    if hi % inner:
        boxes += within(last, 0, hi % inner)
    return boxes


@dataclass(frozen=True)
class Placement:
    """Where a rank's tp-local tensor sits in the global one."""

    shape: torch.Size  # global
    offsets: tuple[int, ...]  # of the local tensor


def tp_placements(module: nn.Module, tp: comm.CommGroup) -> dict[str, Placement]:
    """{name: placement} for every parameter of `module` (split ones offset by tp rank)."""
    split = {name: dim for name, (_, dim) in sharded_parameters(module).items()}
    out = {}
    for name, p in module.named_parameters():
        shape, offsets = list(p.shape), [0] * p.dim()
        if name in split:
            dim = split[name]
            offsets[dim] = tp.rank * shape[dim]
            shape[dim] *= tp.size
        out[name] = Placement(torch.Size(shape), tuple(offsets))
    return out


def _whole(tensor: torch.Tensor, where: Placement) -> Sharded:
    return Sharded(where.shape, [Box(where.offsets, tensor)])


def _pieces(shard: FlatShard, flat: torch.Tensor, where: dict[str, Placement]) -> dict:
    """{name: Sharded} for the parameter pieces in `flat` (shaped like the shard)."""
    out = {}
    for piece in shard.layout.local_pieces(shard.rank):
        name = piece.segment.name
        values = flat[piece.shard_offset : piece.shard_offset + piece.numel]
        place = where[name]
        boxes = []
        ranges = flat_range_boxes(tuple(piece.segment.shape), piece.lo, piece.hi)
        for offsets, sizes, start in ranges:
            view = values[start - piece.lo : start - piece.lo + math.prod(sizes)].view(sizes)
            glob = tuple(o + p for o, p in zip(offsets, place.offsets, strict=True))
            boxes.append(Box(glob, view))
        out[name] = Sharded(place.shape, boxes)
    return out


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `param`, created (zeros, step 0) if no step has run yet."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


@dataclass
class RankState:
    """What this rank holds: tensors by checkpoint key, and AdamW's step counters."""

    tensors: dict[str, Sharded]
    step_counters: list[torch.Tensor]  # AdamW's per-parameter "step", all equal

    def adam_step(self) -> int:
        return int(self.step_counters[0]) if self.step_counters else 0

    def set_adam_step(self, step: int) -> None:
        for counter in self.step_counters:
            counter.fill_(float(step))


def rank_state(wrappers: list, optimizer, tp: comm.CommGroup) -> RankState:
    """Model values (fp32 master copies where they exist) and AdamW moments, as boxes.

    Keys: `model.<name>`, `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`.
    """
    tensors: dict[str, Sharded] = {}
    counters: list[torch.Tensor] = []
    optimizers = getattr(optimizer, "optimizers", None)
    for i, w in enumerate(wrappers):
        where = tp_placements(w.module, tp)
        if isinstance(w, DataParallel):
            for name, p in w.module.named_parameters():
                state = _adam_state(optimizer, p)
                counters.append(state["step"])
                tensors[f"model.{name}"] = _whole(p.data, where[name])
                for key in MOMENTS:
                    tensors[f"optim.{key}.{name}"] = _whole(state[key], where[name])
            continue
        inner = optimizers[i].inner
        shards = w.shards if isinstance(w, FullyShardedDataParallel) else [w.shard]
        for shard in shards:
            tensors |= {f"model.{n}": s for n, s in _pieces(shard, shard.optimized, where).items()}
            if not shard.optimized.numel():
                continue  # nothing of this buffer lives here; the optimizer skipped it
            state = _adam_state(inner, shard.optimized)
            counters.append(state["step"])
            for key in MOMENTS:
                pieces = _pieces(shard, state[key], where)
                tensors |= {f"optim.{key}.{n}": s for n, s in pieces.items()}
        # Names that live in this wrapper but whose pieces are all on other dp ranks:
        # present with no boxes, so every rank's key set is the same.
        for name, place in where.items():
            for key in ("model", *(f"optim.{m}" for m in MOMENTS)):
                tensors.setdefault(f"{key}.{name}", Sharded(place.shape, []))
    return RankState(tensors, counters)


@torch.no_grad()
def after_load(wrappers: list) -> None:
    """Make every copy agree with the values just loaded into the optimized tensors.

    Mixed precision: the 16-bit compute weights follow the fp32 master. ZeRO-1/2: every
    rank loaded only its shard; the full parameters are all-gathered. FSDP: gathered units
    are dropped, so the next forward gathers the loaded shards.
    """
    for w in wrappers:
        if isinstance(w, DataParallel):
            continue
        shards = w.shards if isinstance(w, FullyShardedDataParallel) else [w.shard]
        for shard in shards:
            if shard.master is not None:
                shard.param.copy_(shard.master)
        if isinstance(w, ZeroDataParallel) and w.stage >= 1:
            w._gather_params()
        if isinstance(w, FullyShardedDataParallel):
            for unit in w.units:
                unit.free()
