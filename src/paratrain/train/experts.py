"""A run's mixture of experts: the MoE layers made parallel, the wrappers' parameter shares
(and each share's HSDP groups), and the step's routing log (docs/experts.md).

Every MoE layer (models/plans.py `moe_layers`) routes over the whole batch: its view of the
batch spans the data-parallel ranks (GroupBatch), so capacity, queues and balancing
statistics are those of one process holding the whole batch, whatever the layout. With
ep > 1 its experts are split over the mesh's ep group (apply_expert_parallel) and the
data-parallel wrapping splits in two shares, each reduced over the ranks that hold the
same values:

    dense (attention, router, shared expert): dp          every rank holds them
    experts:                                  expert_dp   the ranks holding the same experts

With the token-summed losses of the flat engine both are sums, then divided by the global
token count: an expert's gradient arrives already summed over its ep group (the
all-to-all's backward), and the sum over expert_dp adds the remaining shards, so every
shard counts once, as in the dense sum over dp (grads.py derives the 1/R of mean losses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.mesh import Mesh
from paratrain.models.moe import MoEFeedForward
from paratrain.models.plans import EXPERTS, ModelPlan
from paratrain.module_names import matching
from paratrain.parallel.data_parallel.hybrid import HybridGroups
from paratrain.parallel.data_parallel.param_share import EVERY_PARAMETER, ParamShare
from paratrain.parallel.expert_parallel import GroupBatch, apply_expert_parallel


def moe_layer_names(model: nn.Module, plan: ModelPlan) -> list[str]:
    """The model's MoE layers, by name ("blocks.*.mlp": one per block); [] when dense."""
    names = matching(model, plan.moe_layers)
    return [n for n in names if isinstance(model.get_submodule(n), MoEFeedForward)]


@dataclass(frozen=True)
class DataGroups:
    """The mesh groups (mesh_shape.py) data parallelism works over. `reduce` and `experts`:
    the ranks whose gradients the dense and the split experts' wrappers sum (and route a
    mixture of experts over); `across`: HSDP all-reduces the reduced shards over
    dp_replicate. A synchronous run spans every data-parallel rank; DiLoCo
    (parallel/diloco.py) keeps each replica group to itself, the groups meeting only in
    the outer step. Evaluation, after the last step, always spans them all (dp_cp)."""

    reduce: str = "dp_cp"
    experts: str = "expert_dp"
    across: bool = True

    @classmethod
    def of(cls, dp_mode: str) -> DataGroups:
        return cls("dp_shard", "expert_shard", False) if dp_mode == "diloco" else cls()


def apply_experts(
    model: nn.Module, plan: ModelPlan, mesh: Mesh, groups: DataGroups = DataGroups()
) -> list[tuple[ParamShare, comm.CommGroup]]:
    """Make the MoE layers route over the whole batch of `groups.reduce` and, with ep > 1,
    split their experts; return the data-parallel wrappers' shares with their reduction
    groups (one for a dense model or ep = 1: experts then live whole on every rank, like
    any parameter)."""
    layers = moe_layer_names(model, plan)
    batch = mesh.group(groups.reduce)
    for name in layers:  # a seam of models/moe.py; torch types Module.__setattr__ narrowly
        model.get_submodule(name).batch = GroupBatch(batch)  # type: ignore[assignment]
    ep = mesh.group("ep")
    if not layers or ep.size == 1:
        return [(EVERY_PARAMETER, batch)]
    apply_expert_parallel(model, layers, ep, batch)
    prefixes = tuple(f"{name}.{EXPERTS}." for name in layers)
    names = [n for n, _ in model.named_parameters()]
    experts = frozenset(n for n in names if n.startswith(prefixes))
    dense = frozenset(n for n in names if n not in experts)
    # ZeRO-3 gathers each layer's experts on their own, over expert_dp (the ep-local
    # module that apply_expert_parallel made), in forward order.
    units = tuple((f"{name}.{EXPERTS}.local",) for name in layers)
    return [
        (ParamShare(dense), batch),
        (ParamShare(experts, split_over=ep, units=units), mesh.group(groups.experts)),
    ]


def hybrid_groups(
    mesh: Mesh, share: ParamShare = EVERY_PARAMETER, groups: DataGroups = DataGroups()
) -> HybridGroups | None:
    """HSDP's shard and replicate groups (mesh.py) for a wrapper of `share`, or None
    without replica groups (or when they stay apart, `groups.across` False): the split
    experts (`split_over` ep) shard over the ranks of their replica group that hold the
    same experts; every share all-reduces across the groups over dp_replicate, since a
    replica group holds every expert."""
    if mesh.size("dp_replicate") == 1 or not groups.across:
        return None
    shard = "expert_shard" if share.split_over is not None else "dp_shard"
    return HybridGroups(mesh.group(shard), mesh.group("dp_replicate"))


def routing_log(
    layers: Sequence[MoEFeedForward], group: comm.CommGroup, pp: comm.CommGroup | None = None
) -> dict[str, float] | None:
    """The step's routing over every MoE layer, from the layers' tallies (then cleared):
    tokens per expert (min and max over layers and experts, kept assignments summed over
    the step's micro-batches), the dropped fraction of the assignments, and the auxiliary
    loss (its mean over the dp shards is the batch's; summed over layers, averaged over
    micro-batches). None for a dense model. Collective over `group` (one small all-reduce)
    and, with a pipeline, over `pp` (two more: each stage holds its blocks' layers)."""
    taken = [m.take_tally() for m in layers]
    tallies = [t for t in taken if t is not None]
    if not tallies:
        return None
    kept = torch.stack([t.kept for t in tallies]).double()  # (layers, E)
    aux = torch.stack([t.aux / t.forwards for t in tallies]).sum().double().reshape(1)
    comm.all_reduce(aux, group, op="avg")
    sums = torch.cat([aux, kept.new_tensor([sum(t.dropped for t in tallies),
                                            sum(t.assignments for t in tallies)])])  # fmt: skip
    extremes = torch.stack([kept.max(), -kept.min()])
    if pp is not None and pp.size > 1:
        comm.all_reduce(sums, pp, op="sum")
        comm.all_reduce(extremes, pp, op="max")
    aux_loss, dropped, assignments = sums.tolist()
    return {
        "expert_tokens_min": int(-extremes[1]),
        "expert_tokens_max": int(extremes[0]),
        "dropped_fraction": dropped / max(assignments, 1),
        "aux_loss": aux_loss,
    }


def balance_biases(layers: Sequence[MoEFeedForward]) -> None:
    """After an optimizer step: DeepSeek-V3's bias update on every MoE layer that has one."""
    for layer in layers:
        layer.balance_bias()
