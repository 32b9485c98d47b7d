"""What each rank of `paratrain bench tp` runs: our tensor-parallel step and DTensor's, on
the same batches, one untimed counted step then pair by pair.

Ours is the engine `paratrain train --tp k` builds (`build_engine`: `apply_tensor_parallel`
with GPT_TP_PLAN, and the sequence-parallel gradient sum inside the step) and the one
`train_step`; the peer is `parallelize_module` (peer.py) stepped by `torch_step` with
`loss_parallel()`. Both clip at the same global gradient norm. Every tp rank takes the
whole batch: tensor parallelism splits the model, not the data.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch.distributed.tensor.parallel import loss_parallel

from paratrain.bench.harness.bytes_sent import PeerTraffic, ours_by_op
from paratrain.bench.harness.pairs import PairRow, time_pairs
from paratrain.bench.harness.sides import OurSide, full_parameters, torch_step
from paratrain.bench.tp.peer import build_peer_adamw, describe_plan, parallelize_gpt_dtensor
from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.parallel.tensor_parallel import full_state_dict
from paratrain.train.build import build_engine, build_model, compile_units


def compare_modes(
    rank: int, world: int, batches: list[torch.Tensor], modes: tuple[bool, ...], cfg: RunConfig
) -> list[dict[str, Any]]:
    """Each sequence-parallel mode in one launch (importing DTensor costs a rank seconds)."""
    return [compare_with_dtensor(rank, world, batches, sp, cfg) for sp in modes]


def compare_with_dtensor(
    rank: int, world: int, batches: list[torch.Tensor], sp: bool, cfg: RunConfig
) -> dict[str, Any]:
    """One rank of the comparison: per-pair times and losses, bytes, final parameters."""
    t = cfg.train
    mesh = Mesh.build(tp=world)
    ours = OurSide(build_engine(_tp_config(cfg, world, sp), mesh), cfg)
    module, _, plan = parallelize_gpt_dtensor(build_model(cfg), world, sp)
    compile_units(module, cfg)  # --compile: after tensor parallelism, as ours
    opt = build_peer_adamw(module, t.lr, t.weight_decay, (t.beta1, t.beta2))
    peer = functools.partial(
        torch_step, module, opt, lr=t.lr, grad_clip=t.grad_clip, forward=loss_parallel
    )
    # The first (untimed) step of each counts the bytes of one whole step.
    mesh.ledger.reset()
    first_ours = ours([batches[0]])
    ours_ops = ours_by_op(mesh.ledger)
    norm = PeerTraffic(world, rank)  # the peer's gradient norm and clip, counted apart
    with PeerTraffic(world, rank) as counter:
        first_peer = peer([batches[0]], norm_scope=norm)
    rows = [PairRow(0.0, 0.0, first_ours, first_peer)]
    rows += time_pairs(ours, peer, [[b] for b in batches[1:]])
    ours_full = full_state_dict(ours.engine.replicas[0].module, mesh.group("tp"))
    peer_full = full_parameters(module)
    return {
        "rows": rows,
        "max_param_diff": max((ours_full[n] - p).abs().max().item() for n, p in peer_full.items()),
        "ours_bytes": sum(x["bytes_sent"] for x in ours_ops.values()),
        "ours_ops": ours_ops,
        "torch_bytes": counter.bytes_sent(),
        "torch_ops": counter.summary(),
        "torch_norm_bytes": norm.bytes_sent(),
        "torch_unsized": dict(counter.unsized),
        "peer_plan": describe_plan(plan),
    }


def _tp_config(cfg: RunConfig, world: int, sp: bool) -> RunConfig:
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = world, sp
    return cfg
