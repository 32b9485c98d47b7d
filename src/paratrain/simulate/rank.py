"""One simulated rank: `paratrain train`'s own loop (train/loop.py `train`) on this rank of
a fake world, and what it measured per step, under the keys the prediction uses.

The measurement is taken as `paratrain train` takes it (train/prediction.py): the model
state is the loop's record at the last step's end; bytes and calls per group are the
ledger's between the last two step ends (the first step also carries set-up), and the
FLOPs are `FlopCounterMode`'s between the same two marks. After the last step, one
checkpoint's save planning (save_plan.py): the tensor bytes of this rank's DCP plan.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from paratrain.comm import compat
from paratrain.comm.group import CommOptions
from paratrain.config import RunConfig, device_type
from paratrain.data.tokens import TokenData
from paratrain.mesh import Mesh
from paratrain.plan.rank_traffic import AXES
from paratrain.simulate.fake import SimulatedTensors, join_fake_world
from paratrain.simulate.memory import LiveStorages
from paratrain.simulate.save_plan import local_save_plan, planned_tensor_bytes
from paratrain.train.loop import train
from paratrain.train.prediction import STATE_KINDS


def fake_tokens(cfg: RunConfig) -> TokenData:
    """Token streams just long enough for the run's steps and validation: shapes only."""
    t = cfg.train
    train_len = t.steps * t.global_batch * t.seq_len + 1
    val_len = t.val_batches * t.micro_batch * t.seq_len + 1
    return TokenData(
        train=torch.zeros(train_len, dtype=torch.int32),
        val=torch.zeros(val_len, dtype=torch.int32),
        vocab_size=cfg.model.vocab_size,
        fingerprint="simulated",
        description="fake tokens (simulation)",
    )


class StepMarks:
    """The ledger's bytes and calls per group and the FLOPs so far, at each step's end."""

    def __init__(self, mesh: Mesh, flops: FlopCounterMode, memory: LiveStorages) -> None:
        self.mesh, self.flops, self.memory = mesh, flops, memory
        self.marks: list[dict[str, Any]] = []

    def mark(self, *_: Any) -> None:
        self.memory.mark()
        totals = self.mesh.ledger.totals()
        self.marks.append(
            {
                "bytes": {a: self.mesh.ledger.bytes_sent(group=a) for a in AXES},
                "calls": {a: sum(t.calls for (g, _), t in totals.items() if g == a) for a in AXES},
                "flops": self.flops.get_total_flops(),
            }
        )

    def last_step(self) -> dict[str, Any]:
        before, after = self.marks[-2], self.marks[-1]
        return {
            "bytes": {a: after["bytes"][a] - before["bytes"][a] for a in AXES},
            "calls": {a: after["calls"][a] - before["calls"][a] for a in AXES},
            "flops": after["flops"] - before["flops"],
            "memory": self.memory.steps[-1],
        }


def simulate_rank(cfg: RunConfig, rank: int) -> dict[str, Any]:
    """Build and train global rank `rank` of cfg's layout in this process, on fake
    tensors and the fake backend; its measurement. The process joins a fake world: run
    it in a process of its own (ranks.py)."""
    torch.set_num_threads(1)
    join_fake_world(rank, cfg.world_size)
    try:
        with SimulatedTensors():
            mesh = build_mesh(cfg, control_backend="fake")
            measured = measure_training(cfg, mesh, fake_tokens(cfg))
            mesh.close()
    finally:
        dist.destroy_process_group()
    return {"rank": rank, **measured}


def simulate_rank_on_host(cfg: RunConfig, rank: int) -> tuple[dict[str, Any], dict[str, float]]:
    """`simulate_rank`, and what it cost this machine: seconds and the process's peak
    resident memory (the process is the rank's own, so the peak is the rank's)."""
    start = time.perf_counter()
    measured = simulate_rank(cfg, rank)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return measured, {"seconds": time.perf_counter() - start, "max_rss_bytes": peak_kib * 1024}


def build_mesh(cfg: RunConfig, control_backend: str = "gloo") -> Mesh:
    """The mesh `paratrain train` builds for cfg (train/worker.py), on the run's device
    type (one GPU's index does not matter to a simulation)."""
    p = cfg.parallel
    options = CommOptions(timeout_s=p.comm_timeout_s, algo=p.comm_algo, order=p.comm_order)
    device = torch.device(device_type(cfg))
    return Mesh.build(
        dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, options=options, device=device,
        replicas=p.replicas, control_backend=control_backend,
    )  # fmt: skip


def measure_training(cfg: RunConfig, mesh: Mesh, data: TokenData) -> dict[str, Any]:
    """Train on `mesh` as `paratrain train` does; the model state at the last step's end,
    the ledger's bytes and calls per group and the FLOPs of the last step. The same on a
    real mesh: the faithfulness tests measure real runs with it."""
    with compat.total_flop_counter() as flops, LiveStorages((data.train, data.val)) as memory:
        marks = StepMarks(mesh, flops, memory)
        result = train(cfg, mesh, data, marks.mark, on_start=marks.mark)
    state = result.extra["model_state_bytes"]
    saved = planned_tensor_bytes(local_save_plan(result.engine, result.optimizer, mesh))
    return {**{k: int(state[k]) for k in STATE_KINDS}, **marks.last_step(), "checkpoint": saved}
