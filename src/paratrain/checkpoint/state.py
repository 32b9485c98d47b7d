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
  2 * ndim - 1 boxes (a partial row, whole rows, a partial row), each still contiguous.
  Every wrapper describes what it holds the same way (`Replica.checkpoint_pieces`: flat
  ranges of each parameter, the whole range where nothing is sharded);
- pipeline parallelism simply leaves other stages' names out.

Persistent buffers (DeepSeek-V3's router bias, which bias balancing moves after every step)
are saved beside the parameters as `buffer.<name>`, one whole box each: every rank that
holds the module holds the same values (the bias is computed from the global counts), and
DCP writes identical boxes once. A non-persistent buffer (a MoE's per-step load count) is
not state: it is empty at every step boundary.

DTensor says the same for even dim-0 shards (FSDP2); a flat range that cuts rows is not a
DTensor placement, hence these boxes, which torch.distributed.checkpoint stores as chunks
(`planner.py`). Every box's `data` is a view of live storage: saving reads the
training state without copying it, loading writes into it in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel.replica import MOMENTS, Checkpointed, StatePiece
from paratrain.parallel.expert_parallel import expert_placements
from paratrain.parallel.tensor_parallel.state import sharded_parameters


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
    """Where a rank's tp-local (or ep-local) tensor sits in the global one."""

    shape: torch.Size  # global
    offsets: tuple[int, ...]  # of the local tensor
    name: str  # the global tensor's name, as the plain model has it


def tp_placements(module: nn.Module, tp: comm.CommGroup) -> dict[str, Placement]:
    """{name: placement} for every parameter of `module` (split ones offset by tp rank;
    experts split by expert parallelism offset along dimension 0 by ep rank, under the
    plain model's name)."""
    split = {name: dim for name, (_, dim) in sharded_parameters(module).items()}
    experts = expert_placements(module)
    out = {}
    for name, p in module.named_parameters():
        shape, offsets = list(p.shape), [0] * p.dim()
        if name in split:
            dim = split[name]
            offsets[dim] = tp.rank * shape[dim]
            shape[dim] *= tp.size
        key = name
        if name in experts:
            key, rank, size = experts[name]
            offsets[0] = rank * shape[0]
            shape[0] *= size
        out[name] = Placement(torch.Size(shape), tuple(offsets), key)
    return out


def _boxes(piece: StatePiece, values: torch.Tensor, place: Placement) -> Sharded:
    """The boxes of one flat piece (`values`: its (hi - lo,) elements) in the global tensor."""
    boxes = []
    for offsets, sizes, start in flat_range_boxes(tuple(piece.shape), piece.lo, piece.hi):
        view = values[start - piece.lo : start - piece.lo + math.prod(sizes)].view(sizes)
        glob = tuple(o + p for o, p in zip(offsets, place.offsets, strict=True))
        boxes.append(Box(glob, view))
    return Sharded(place.shape, boxes)


BUFFER = "buffer."  # the key prefix of a persistent buffer; parameters' is "model."


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} for the module's persistent buffers: what its state_dict holds beside
    the parameters (the parameters are the optimizer's, saved with their moments)."""
    state = module.state_dict(keep_vars=True)
    return {name: t for name, t in state.items() if not isinstance(t, nn.Parameter)}


def buffer_state(modules: list[nn.Module]) -> dict[str, Sharded]:
    """`buffer.<name>` -> one whole box of the live buffer, for each distinct module (expert
    parallelism wraps one module twice). Replicated as a whole: buffers that tensor
    parallelism would split are not (none of our models has one)."""
    out: dict[str, Sharded] = {}
    for module in {id(m): m for m in modules}.values():
        for name, t in persistent_buffers(module).items():
            out[BUFFER + name] = Sharded(t.shape, [Box((0,) * t.dim(), t)])
    return out


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


def _moment_keys(optimizer: Any, name: str) -> tuple[str, ...]:
    """The optimizer state a checkpoint stores beside parameter `name` (torch's AdamW,
    which has no `moment_keys`: its two moments)."""
    keys = getattr(optimizer, "moment_keys", None)
    return tuple(keys(name)) if keys is not None else MOMENTS


def _prefix(key: str) -> str:
    """A piece's tensor key as the checkpoint spells it: `model`, `outer.velocity` (DiLoCo's
    outer momentum), or `optim.<moment>`."""
    return {"model": "model", "outer_velocity": "outer.velocity"}.get(key, f"optim.{key}")


def rank_state(
    replicas: Sequence[Checkpointed],
    optimizers: Sequence[Any],
    tp: comm.CommGroup,
    outer: Sequence[torch.Tensor] | None = None,
) -> RankState:
    """Model values (fp32 master copies where they exist) and AdamW moments, as boxes.

    Keys: `model.<name>`, `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>` (a Muon matrix:
    `optim.momentum_buffer.<name>`), and
    `buffer.<name>` for persistent buffers; a frozen parameter has only `model.<name>`,
    whole (`frozen_state`). A name whose pieces all live on other dp ranks
    is present with no boxes, so that every rank's key set is the same. `outer`: DiLoCo's
    outer momentum, one tensor per piece in the order the replicas give their pieces,
    saved as `outer.velocity.<name>`.
    """
    tensors: dict[str, Sharded] = {}
    counters: list[torch.Tensor] = []
    places: dict[str, tuple[Any, tuple[str, ...]]] = {}  # name -> (place, its moments)
    kept: set[str] = set()  # the places this rank holds pieces of, under their own keys
    velocity = iter(outer or ())
    extra = ("outer_velocity",) if outer is not None else ()
    for replica, optimizer in zip(replicas, optimizers, strict=True):
        where = tp_placements(replica.module, tp)
        frozen_names = {n for n, p in replica.module.named_parameters() if not p.requires_grad}
        for local, place in where.items():
            moments = () if local in frozen_names else _moment_keys(optimizer, local)
            places.setdefault(place.name, (place, moments))
        pieces, steps = replica.checkpoint_pieces(optimizer)
        counters += steps
        for piece in pieces:
            place = where[piece.name]
            kept.add(place.name)
            for key, values in piece.tensors.items():
                tensors[f"{_prefix(key)}.{place.name}"] = _boxes(piece, values, place)
            for key in extra:
                tensors[f"{_prefix(key)}.{place.name}"] = _boxes(piece, next(velocity), place)
    assert next(velocity, None) is None, "one outer momentum per piece"
    frozen = frozen_state(replicas, tp, kept | sharded_frozen(replicas, tp))
    for name, (place, moments) in places.items():
        if name not in kept and f"model.{name}" not in frozen:  # held on other dp ranks
            for key in ("model", *moments, *(extra if moments else ())):
                tensors[f"{_prefix(key)}.{name}"] = Sharded(place.shape, [])
    tensors.update(frozen)
    tensors.update(buffer_state([r.module for r in replicas]))
    return RankState(tensors, counters)


def sharded_frozen(replicas: Sequence[Checkpointed], tp: comm.CommGroup) -> set[str]:
    """The frozen parameters a wrapper shards (ZeRO-3's `frozen_shards`), by global name:
    their pieces are saved by the ranks that hold them, none of them whole."""
    out = set()
    for replica in replicas:
        where = tp_placements(replica.module, tp)
        for shard in getattr(replica, "frozen_shards", ()):  # ZeRO-1/2, DP: none
            out |= {where[seg.name].name for seg in shard.layout.segments}
    return out


def frozen_state(
    replicas: Sequence[Checkpointed], tp: comm.CommGroup, held: set[str]
) -> dict[str, Sharded]:
    """`model.<name>` -> one box of the live tensor, for each frozen parameter (a LoRA run's
    base: parallel/lora.py) that no wrapper holds (`held`: ZeRO-3 shards it): every
    rank of its dp group has it whole (DCP writes the identical boxes once). A frozen
    parameter has no optimizer state."""
    out: dict[str, Sharded] = {}
    for replica in replicas:
        where = tp_placements(replica.module, tp)
        for name, p in replica.module.named_parameters():
            if not p.requires_grad and where[name].name not in held:
                place = where[name]
                out[f"model.{place.name}"] = Sharded(place.shape, [Box(place.offsets, p.data)])
    return out
