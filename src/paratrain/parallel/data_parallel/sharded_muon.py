"""Muon over ZeRO's flat shards (ZeRO-1/2/3 and HSDP): each rank holds pieces of the
matrices, and Newton-Schulz needs each one whole.

Each rank keeps Muon's momentum for its own pieces only (sharded like AdamW's moments)
and AdamW's moments for the runs of other parameters in its shards. One step, after the
gradients are reduce-scattered into the shards:
1. AdamW steps the runs of other parameters;
2. each rank moves the momentum of its pieces and forms their update (Nesterov or not);
3. one all-to-all sends every piece's update, in float32, to the rank that owns its
   matrix (plan/muon.py `owners_among`: a rank that holds a piece of it, so a matrix
   inside one shard never travels, the work balanced among the holders), which assembles the
   matrices, orthogonalizes each once and sends every rank, in a second all-to-all, the
   result for its pieces, as raw bytes of the Newton-Schulz precision;
4. each rank applies W <- W (1 - lr wd) - lr_adj O to its pieces, and the wrapper
   gathers the parameters as after AdamW.
Under tensor parallelism the shards hold pieces of each matrix's tp shard, the same
pieces on every tp rank (their layouts are the same), so an owner assembles its
matrices' tp shards; between the two all-to-alls the owners at one dp place put each
matrix together over tp, as WholeMuon does (muon_exchange.py: one tp rank orthogonalizes
it, the work spread over them), and take back their shards of the results.
Only the pieces of matrices that straddle shards cross the wire, each at most twice: no
rank gathers the model. The arithmetic per element is WholeMuon's (muon.py), so the
result is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from paratrain import comm
from paratrain.comm import compat
from paratrain.parallel.data_parallel import muon_exchange, muon_math
from paratrain.parallel.data_parallel.adamw import decays, fastest
from paratrain.parallel.data_parallel.flat_buffer import FlatShard, Piece
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.muon_pieces import adamw_runs, pieces_by_rank
from paratrain.parallel.data_parallel.replica import MOMENTS, MUON_MOMENTUM
from paratrain.parallel.data_parallel.whole_module import adam_state
from paratrain.parallel.mixed_precision import DynamicLossScaler, found_inf
from paratrain.plan.muon import iteration_flops, owners_among, owners_over_tp


class ShardedMuon:
    """Muon over the pieces of `matrices` held in `shards`, AdamW over the rest; driven
    like ShardedAdamW: `param_groups[i]["lr"]`, `step()`, then `after_step`."""

    def __init__(
        self,
        shards: list[FlatShard],
        group: comm.CommGroup,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        matrices: Collection[str],
        settings: MuonSettings,
        after_step: Callable[[], None] | None = None,
        scaler: DynamicLossScaler | None = None,
        tp: comm.CommGroup | None = None,
        split_dims: dict[str, int] | None = None,
    ) -> None:
        """tp, split_dims: the group the matrices are split over and, per matrix, the
        dimension (every matrix of a plan is split under tp)."""
        self.shards, self.group, self.settings = shards, group, settings
        self.weight_decay, self.after_step, self.scaler = weight_decay, after_step, scaler
        self.matrix_names = set(matrices)
        self.runs = adamw_runs(shards, self.matrix_names)
        self.run_params = [shards[si].optimized[a:b] for si, a, b in self.runs]
        adamw: dict[str, Any] = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        adamw |= fastest(self.run_params)
        self.inner = torch.optim.AdamW(self.run_params, **adamw) if self.run_params else None
        self._decayed = [
            s.optimized[p.shard_offset : p.shard_offset + p.numel]
            for s in shards
            for p in s.layout.local_pieces(s.rank)
            if p.segment.name not in self.matrix_names and decays(p.segment.shape)
        ]
        # Every matrix of every shard, in shard then layout order: the same list on each rank.
        self.matrices = [
            (si, seg)
            for si, s in enumerate(shards)
            for seg in s.layout.segments
            if seg.name in self.matrix_names
        ]
        # The ranks the buffers are split over (1 under ZeRO stage 0: every rank holds all).
        self.k = shards[0].layout.k if shards else 1
        self.me = shards[0].rank if shards else 0
        self.pieces = pieces_by_rank(shards, self.matrices, self.k)  # [q][i]: q's piece of i
        self.tp = tp if tp is not None and tp.size > 1 else None
        t = self.tp.size if self.tp is not None else 1
        self.dims = [(split_dims or {}).get(seg.name, 0) for _, seg in self.matrices]
        local = [tuple(seg.shape) for _, seg in self.matrices]
        self.shapes = muon_exchange.whole_shapes(local, self.dims, t)
        costs = [iteration_flops((rows, cols)) for rows, cols in self.shapes]
        held = [
            {q: self.pieces[q][i].numel for q in range(self.k) if i in self.pieces[q]}
            for i in range(len(self.matrices))
        ]
        self.owners = owners_among(costs, held, self.k)
        self.tp_owners = owners_over_tp(self.owners, costs, self.k, t)
        self.momentum = {
            i: shards[self.matrices[i][0]].optimized.new_zeros(p.numel)
            for i, p in self.pieces[self.me].items()
        }
        self.muon_group: dict[str, Any] = {"params": [], "lr": lr, "weight_decay": weight_decay}
        self.steps_skipped = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        adamw = self.inner.param_groups if self.inner is not None else []
        return [*adamw, self.muon_group]

    @property
    def states(self) -> list[dict[str, Any]]:
        """Every state dict this optimizer holds (the memory report counts them)."""
        adamw = list(self.inner.state.values()) if self.inner is not None else []
        return adamw + [{MUON_MOMENTUM: m} for m in self.momentum.values()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the wrapper (`wrapper.zero_grad()`); nothing to do here."""

    @torch.no_grad()
    def step(self) -> None:
        if self.scaler is not None:
            overflow = found_inf([s.grad for s in self.shards], self.group)
            self.scaler.update(overflow)
            if overflow:
                self.steps_skipped += 1
                return
        self._adamw_step()
        self._muon_step()
        for s in self.shards:
            if s.master is not None:
                s.param.copy_(s.master)  # the 16-bit compute copy follows the master
        if self.after_step is not None:
            self.after_step()

    def _adamw_step(self) -> None:
        if self.inner is None:
            return
        for (si, a, b), v in zip(self.runs, self.run_params, strict=True):
            v.grad = self.shards[si].grad[a:b].to(v.dtype)
        lr = self.inner.param_groups[0]["lr"]
        if self.weight_decay and self._decayed:
            compat.foreach_mul_(self._decayed, 1.0 - lr * self.weight_decay)
        self.inner.step()
        for v in self.run_params:
            v.grad = None

    def _muon_step(self) -> None:
        s, me = self.settings, self.me
        updates: dict[int, torch.Tensor] = {}
        for i, p in self.pieces[me].items():
            shard = self.shards[self.matrices[i][0]]
            grad = shard.grad[p.shard_offset : p.shard_offset + p.numel].to(torch.float32)
            buf = self.momentum[i]
            buf.lerp_(grad, 1 - s.momentum)
            updates[i] = grad.lerp(buf, s.momentum) if s.nesterov else buf
        whole = self._to_owners(updates)
        if self.tp is None:
            flat = {
                i: muon_math.newton_schulz(m, s.ns_steps, s.ns_dtype).reshape(-1)
                for i, m in whole.items()
            }
        else:
            flat = self._over_tp(whole)
        results = self._from_owners(flat)
        lr, decay = self.muon_group["lr"], self.muon_group["weight_decay"]
        for i, p in self.pieces[me].items():
            si, _ = self.matrices[i]
            view = self.shards[si].optimized[p.shard_offset : p.shard_offset + p.numel]
            view.mul_(1 - lr * decay)
            view.add_(results[i], alpha=-muon_math.adjusted_lr(lr, self.shapes[i], s.lr_adjust))

    def _over_tp(self, whole: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This rank's tp shard (flat, Newton-Schulz precision) of each result it owns over
        dp: the tp ranks at its dp place hold the other shards of the same matrices."""
        assert self.tp is not None
        s, owners = self.settings, self.tp_owners
        shapes = {i: m.shape for i, m in whole.items()}
        # Each stage's buffers go once used, as in WholeMuon._split_results
        full = muon_exchange.gather_to_owners(whole, owners, self.dims, self.me, self.tp)
        done = {i: muon_math.newton_schulz(full.pop(i), s.ns_steps, s.ns_dtype)
                for i in sorted(full)}  # fmt: skip
        return muon_exchange.scatter_from_owners(
            done, shapes, owners, self.dims, self.me, self.tp, s.ns_dtype
        )

    def _owned(self, rank: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def _to_owners(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each owner's matrices whole, from every rank's pieces (float32 all-to-all).
        `updates` is emptied once packed: Nesterov's are copies, not to sit beside the
        all-to-all's buffers (ZeRO-1 gpt-tiny over tp 2, dp 2: +33.5% over the planner's
        peak with every stage's buffers kept to the step's end, +1.0% so)."""
        me, k = self.me, self.k
        send = [updates[i] for r in range(k) for i in self._owned(r) if i in updates]
        ins = [
            sum(self.pieces[me][i].numel for i in self._owned(r) if i in self.pieces[me])
            for r in range(k)
        ]
        mine = self._owned(me)
        outs = [sum(self.pieces[q][i].numel for i in mine if i in self.pieces[q]) for q in range(k)]
        device = self.shards[0].optimized.device
        flat = torch.cat(send) if send else torch.empty(0, device=device)
        send.clear()
        updates.clear()
        got = comm.all_to_all(flat, self.group, ins, outs) if k > 1 else flat
        del flat
        whole = {i: torch.empty(self.matrices[i][1].numel, device=device) for i in mine}
        offset = 0
        for q in range(k):
            for i in mine:
                p = self.pieces[q].get(i)
                if p is not None:
                    whole[i][p.lo : p.hi] = got[offset : offset + p.numel]
                    offset += p.numel
        return {i: m.view(self.matrices[i][1].shape) for i, m in whole.items()}

    def _from_owners(self, flat: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every rank's pieces of the results, from their owners' `flat` results (in the
        matrices' row-major order; an all-to-all of the Newton-Schulz precision's bytes),
        which are emptied once packed."""
        me, k, dtype = self.me, self.k, self.settings.ns_dtype
        width = dtype.itemsize
        mine = self._owned(me)
        send = [
            flat[i][self.pieces[q][i].lo : self.pieces[q][i].hi]
            for q in range(k)
            for i in mine
            if i in self.pieces[q]
        ]
        ins = [
            width * sum(self.pieces[q][i].numel for i in mine if i in self.pieces[q])
            for q in range(k)
        ]
        outs = [
            width * sum(self.pieces[me][i].numel for i in self._owned(r) if i in self.pieces[me])
            for r in range(k)
        ]
        device = self.shards[0].optimized.device
        out = torch.cat(send).to(dtype) if send else torch.empty(0, device=device, dtype=dtype)
        send.clear()
        flat.clear()
        got = out.view(torch.uint8)
        if k > 1:
            got = comm.all_to_all(got, self.group, ins, outs)
        results, offset = {}, 0
        for r in range(k):
            for i in self._owned(r):
                p = self.pieces[me].get(i)
                if p is not None:
                    results[i] = got[offset : offset + width * p.numel].view(dtype)
                    offset += width * p.numel
        return results

    # -- checkpoints ------------------------------------------------------------------------
    def piece_moments(self, si: int, piece: Piece) -> dict[str, torch.Tensor]:
        """The optimizer state of one piece of shard `si`: Muon's momentum, or AdamW's
        moments (views of live storage)."""
        for i, p in self.pieces[self.me].items():
            if self.matrices[i][0] == si and p == piece:
                return {MUON_MOMENTUM: self.momentum[i]}
        for (rs, a, b), v in zip(self.runs, self.run_params, strict=True):
            if rs == si and a <= piece.shard_offset < b:
                assert self.inner is not None
                state = adam_state(self.inner, v)
                at = slice(piece.shard_offset - a, piece.shard_offset - a + piece.numel)
                return {key: state[key][at] for key in MOMENTS}
        raise KeyError(f"no optimizer state for {piece.segment.name}")

    def step_counters(self) -> list[torch.Tensor]:
        if self.inner is None:
            return []
        return [adam_state(self.inner, v)["step"] for v in self.run_params]

    def moment_keys(self, name: str) -> tuple[str, ...]:
        return (MUON_MOMENTUM,) if name in self.matrix_names else MOMENTS
