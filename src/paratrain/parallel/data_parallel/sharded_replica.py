"""The half of the `Replica` protocol that ZeRO-1/2 and ZeRO-3 share: after the reduction,
the gradient exists only as this rank's flat shards.

`ZeroDataParallel` keeps one flat buffer, `FullyShardedDataParallel` one per unit; both
expose them as `shards` (flat_buffer.FlatShard: compute-dtype parameters, reduced gradient,
fp32 master copy) and say over which group they are disjoint (`sharded_over`: the dp
group, HSDP's replica group (hybrid.py), or None for ZeRO stage 0, whose single shard is
the whole buffer). Scaling, the
squared norms, sums over other groups, the optimizer, checkpoint pieces and full weights
are then the same code for both.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel.adamw import ShardedAdamW
from paratrain.parallel.data_parallel.compression import GradCompressor
from paratrain.parallel.data_parallel.flat_buffer import FlatShard, Piece
from paratrain.parallel.data_parallel.grad_lists import all_reduce_in_place, scale_, squared_norms
from paratrain.parallel.data_parallel.hybrid import HybridGroups, all_reduce_across_replicas
from paratrain.parallel.data_parallel.muon import muon_matrix_names
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.data_parallel.replica import GradSquares, StatePiece
from paratrain.parallel.data_parallel.sgd import ShardedSGD
from paratrain.parallel.data_parallel.sharded_muon import ShardedMuon
from paratrain.parallel.data_parallel.whole_module import complete_state_dict
from paratrain.parallel.mixed_precision import MixedPrecision
from paratrain.parallel.tensor_parallel.state import split_dims


class ShardedReplica(nn.Module, abc.ABC):
    """Base of the sharded wrappers; subclasses set module, group, scaler and implement
    `shards`, `sharded_over` and `_after_update` (what follows an update of the shards)."""

    module: nn.Module
    group: comm.CommGroup
    scaler: Any
    share: ParamShare = EVERY_PARAMETER  # ZeRO-1/2 may hold some of the module's parameters
    hybrid: HybridGroups | None = None  # HSDP: shard within a replica group (hybrid.py)
    compressor: GradCompressor | None = None  # --compress (compression.py): ZeRO-1/2 only
    reduce_op: str
    precision: MixedPrecision

    @property
    def shard_group(self) -> comm.CommGroup:
        """The ranks the flat buffers are split over: the replica group under HSDP."""
        return self.hybrid.shard if self.hybrid is not None else self.group

    def _all_reduce_across_replicas(self) -> None:
        """HSDP: the step's reduced shards, summed (or averaged) over the replicas."""
        if self.hybrid is not None:
            grads = [s.grad for s in self.shards]
            dtype = self.precision.reduce_dtype
            replicate, op = self.hybrid.replicate, self.reduce_op
            all_reduce_across_replicas(grads, replicate, op, dtype, self.compressor)

    @property
    @abc.abstractmethod
    def shards(self) -> list[FlatShard]: ...

    @property
    @abc.abstractmethod
    def sharded_over(self) -> comm.CommGroup | None: ...

    @abc.abstractmethod
    def _after_update(self) -> None:
        """Make the compute parameters follow the updated shards (gather or drop them)."""

    # -- gradients ------------------------------------------------------------------------
    def scale_grads_(self, factor: float) -> None:
        scale_([s.grad for s in self.shards if s.grad.numel()], factor)

    def _held_pieces(self) -> list[tuple[Piece, torch.Tensor]]:
        """(piece, gradient view) of every parameter piece held here, in layout order."""
        return [
            (piece, view)
            for shard in self.shards
            for piece, view in zip(
                shard.layout.local_pieces(shard.rank), shard.piece_views(shard.grad), strict=True
            )
        ]

    def grad_squares(self) -> GradSquares:
        """Squared norms per parameter piece, as torch takes them per tensor."""
        held = self._held_pieces()
        names, views = [p.segment.name for p, _ in held], [v for _, v in held]
        squares = squared_norms(views, self.shards[0].grad.device)
        return GradSquares(names, squares, self.sharded_over, self.share.split_over)

    def all_reduce_grads_(
        self, names: Sequence[str], group: comm.CommGroup, same_layout: bool = True
    ) -> None:
        if group.size == 1 or not names:
            return
        if same_layout:
            self._all_reduce_pieces(names, group)
        else:
            self._all_reduce_whole(names, group)

    def _all_reduce_pieces(self, names: Sequence[str], group: comm.CommGroup) -> None:
        """Every rank of `group` holds the same pieces (tensor-parallel peers: the same
        local parameters in the same flat layout): sum them in place, in one call."""
        all_reduce_in_place([v for p, v in self._held_pieces() if p.segment.name in names], group)

    def _all_reduce_whole(self, names: Sequence[str], group: comm.CommGroup) -> None:
        """The ranks of `group` keep these parameters in different layouts (tied weights
        at the two ends of a pipeline): put this rank's pieces in place in the whole
        gradients, sum over `group` and over the dp ranks (sums commute, and the dp
        ranks' pieces are disjoint), and keep this rank's pieces of the result."""
        numel = {s.name: s.numel for shard in self.shards for s in shard.layout.segments}
        starts, total = {}, 0
        for name in names:  # the named gradients end to end, in the order given
            starts[name], total = total, total + numel[name]
        flat = self.shards[0].grad.new_zeros(total, dtype=self._grad_dtype)
        held = [(p, v) for p, v in self._held_pieces() if p.segment.name in starts]
        for piece, view in held:
            at = starts[piece.segment.name]
            flat[at + piece.lo : at + piece.hi].copy_(view)
        comm.all_reduce(flat, group, op="sum")
        if self.sharded_over is not None:
            comm.all_reduce(flat, self.sharded_over, op="sum")
        for piece, view in held:
            at = starts[piece.segment.name]
            view.copy_(flat[at + piece.lo : at + piece.hi])

    @property
    def _grad_dtype(self) -> torch.dtype:
        return self.shards[0].grad.dtype if self.shards else torch.float32

    # -- the update and its state -----------------------------------------------------------
    def build_optimizer(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        muon: MuonSettings | None = None,
        tp: comm.CommGroup | None = None,
        sgd: bool = False,
    ) -> ShardedAdamW | ShardedMuon:
        if muon is None:
            return (ShardedSGD if sgd else ShardedAdamW)(
                self.shards, self.group, lr, weight_decay, betas, eps, self._after_update,
                self.scaler,
            )  # fmt: skip
        mine = {n for n, _ in self.share.named(self.module)}
        names = [n for n in muon_matrix_names(self.module, muon.matrices) if n in mine]
        dims = split_dims(self.module) if tp is not None and tp.size > 1 else {}
        if dims and any(n not in dims for n in names):  # every plan's matrix is split
            raise ValueError(f"Muon matrices not split over tp: {set(names) - set(dims)}")
        return ShardedMuon(
            self.shards, self.shard_group, lr, weight_decay, betas, eps, names, muon,
            self._after_update, self.scaler, tp, dims,
        )  # fmt: skip

    def checkpoint_pieces(
        self, optimizer: ShardedAdamW | ShardedMuon
    ) -> tuple[list[StatePiece], list[torch.Tensor]]:
        pieces = []
        for si, shard in enumerate(self.shards):
            if not shard.optimized.numel():
                continue  # nothing of this buffer lives here; the optimizer skipped it
            for piece in shard.layout.local_pieces(shard.rank):
                at = slice(piece.shard_offset, piece.shard_offset + piece.numel)
                tensors = {"model": shard.optimized[at]} | optimizer.piece_moments(si, piece)
                seg = piece.segment
                pieces.append(StatePiece(seg.name, seg.shape, piece.lo, piece.hi, tensors))
        for shard in self.frozen_shards:  # their values only: no optimizer state
            for piece in shard.layout.local_pieces(shard.rank):
                at = slice(piece.shard_offset, piece.shard_offset + piece.numel)
                seg, tensors = piece.segment, {"model": shard.param[at]}
                pieces.append(StatePiece(seg.name, seg.shape, piece.lo, piece.hi, tensors))
        return pieces, optimizer.step_counters()

    @property
    def frozen_shards(self) -> list[FlatShard]:
        """Flat shards of frozen parameters (ZeRO-3 shards a LoRA run's base); ZeRO-1/2
        leave them whole in the module."""
        return []

    @torch.no_grad()
    def after_load(self) -> None:
        """The loaded values are in the fp32 master (or parameter) shards: the 16-bit
        compute copies follow, and the full parameters are rebuilt from the shards."""
        for shard in self.shards:
            if shard.master is not None:
                shard.param.copy_(shard.master)
        self._after_update()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, in fp32 (the master values), on every rank (collective)."""
        values = {}
        for shard in [*self.shards, *self.frozen_shards]:
            flat = shard.optimized
            if self.sharded_over is not None:
                sizes = [shard.layout.shard] * self.sharded_over.size
                flat = comm.all_gather_flat(flat, self.sharded_over, sizes=sizes)
            for seg, view in zip(shard.layout.segments, shard.layout.views(flat), strict=True):
                values[seg.name] = view.float().clone()
        return complete_state_dict(self.module, values)
