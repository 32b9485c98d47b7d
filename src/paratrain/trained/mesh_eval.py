"""A run's loss on a mesh (`paratrain eval RUN --nproc N [--tp T --pp P --zero Z]`,
started by commands/eval_launch.py).

For a model too large for one process: each rank builds its part of the model as training
would on this layout (any layout: checkpoints hold global tensors), loads its part of the
latest checkpoint through DCP, and the engine's `evaluate` scores the same windows as the
one-process `eval` (trained/run_model.py: eval_rows), replica r taking rows
r, r + dp, ...; the loss is the mean over every scored token, so the answer does not
depend on the layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from paratrain import checkpoint
from paratrain.checkpoint.load import load_engine_weights
from paratrain.comm.group import CommOptions
from paratrain.config import RunConfig
from paratrain.data.tokens import on_device
from paratrain.mesh import Mesh
from paratrain.token_rows import document_positions, target_count
from paratrain.train.build import build_engine, build_model
from paratrain.train.optim import muon_settings, peak_lr
from paratrain.train.worker import WorkerEnv, init_process_group, rank_device
from paratrain.trained.run_model import (
    eval_rows,
    eval_seq_len,
    scores,
)


@torch.no_grad()
def evaluate_on_mesh(
    cfg: RunConfig, env: WorkerEnv, run_dir: Path, data: str | None, seq_len: int | None
) -> dict[str, float] | None:
    """This rank's part of the evaluation (collective); rank 0 returns the scores."""
    init_process_group(cfg, env)
    p = cfg.parallel
    options = CommOptions(timeout_s=p.comm_timeout_s, algo=p.comm_algo, order=p.comm_order)
    mesh = Mesh.build(
        dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, options=options, device=rank_device(cfg, env)
    )
    try:
        windows = eval_rows(cfg, run_dir, data, eval_seq_len(cfg, seq_len))
        model = build_model(cfg, mesh.device, initial=False)
        engine = build_engine(
            cfg, mesh, model=model, packed=document_positions(windows) is not None
        )
        t = cfg.train
        betas, muon = (t.beta1, t.beta2), muon_settings(cfg)
        optimizer = engine.build_optimizer(peak_lr(cfg), t.weight_decay, betas, muon=muon)
        ckpt = checkpoint.latest_checkpoint(run_dir)
        assert ckpt is not None  # checked before launch
        load_engine_weights(ckpt, engine, optimizer, mesh, cfg)
        batches = on_device(list(windows.split(t.micro_batch)), mesh.device)
        loss = engine.evaluate(batches)
    finally:
        mesh.close()
    dist.destroy_process_group()
    if mesh.global_rank != 0:
        return None
    return scores(loss, target_count(windows))
