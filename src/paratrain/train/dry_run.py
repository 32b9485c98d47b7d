"""`paratrain train --dry-run`: every check a real start runs (the CLI has run them when
this is called), then what the run would be, and no worker started.

Printed: the resolved configuration (as config.toml would hold it), the mesh (each rank's
coordinates, cp and ep included when above 1, its pipeline stage's blocks, and the
planner's model state and bytes per step for that very rank), the data (what was
checked), and the planner's summary for rank 0.
"""

from __future__ import annotations

from paratrain.comm.algos import algorithms_line
from paratrain.config import RunConfig
from paratrain.config.toml_file import to_toml
from paratrain.mesh import AXES, MeshShape
from paratrain.models.plans import PLANS
from paratrain.plan.model import spec_of
from paratrain.plan.muon import block_matrices
from paratrain.plan.pipeline import stage_virtual_stages, virtual_stage_layers
from paratrain.train.optim import warmup_note
from paratrain.train.prediction import MB, describe_prediction, predict


def muon_split(cfg: RunConfig) -> str:
    """Which parameters Muon takes (the plan's matrices: with experts attention's alone)
    and how many AdamW keeps."""
    model = spec_of(cfg.model, cfg.train.seq_len)
    per_block = block_matrices(model.shape, moe=bool(cfg.model.num_experts))
    matrices = per_block * cfg.model.n_layer
    muon = sum(rows * cols for rows, cols in matrices)
    patterns = ", ".join(PLANS[cfg.model.arch].muon_matrices[: len(per_block)])
    return (
        f"optimizer: Muon for {len(matrices)} matrices ({muon:,} parameters: {patterns}); "
        f"AdamW for the other {model.params - muon:,} parameters"
    )


def dry_run_lines(cfg: RunConfig, data: str) -> list[str]:
    p = cfg.parallel
    shape = MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, replicas=p.replicas)
    pred = None if p.dp_mode == "async" else predict(cfg)
    layers = virtual_stage_layers(cfg.model.n_layer, p.pp, p.chunks)
    lines = ["# resolved configuration", to_toml(cfg).rstrip(), "", f"# mesh: {shape.describe()}"]
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        where = ", ".join(f"{a} {c[a]}" for a in AXES if a != "cp" or shape.cp > 1)
        if shape.ep > 1:  # the place in its ep group (a run of ep ranks of dp_cp)
            where += f", ep {shape.group_of('ep', rank).index(rank)}"
        if shape.replicas > 1:  # HSDP: its replica group, and its shard within the group
            replica = shape.group_of("dp_replicate", rank).index(rank)
            where += f", replica {replica} shard {shape.group_of('dp_shard', rank).index(rank)}"
        chunks = stage_virtual_stages(c["pp"], p.pp, p.chunks)
        first = [sum(layers[:vs]) for vs in chunks]
        blocks = "; ".join(
            f"blocks {a}-{a + layers[vs] - 1}" for a, vs in zip(first, chunks, strict=True)
        )
        line = f"rank {rank}: {where}: {blocks}"
        if pred is not None:
            state, sent = pred.model_state[rank]["total"], sum(pred.bytes_per_step[rank].values())
            line += f"; model state {state / MB:.2f} MB, sends {sent / MB:.3f} MB per step"
        lines.append(line)
    lines += ["", f"# {algorithms_line(p.comm_algo)}", "", f"# data: {data}"]
    note = warmup_note(cfg)
    lines += [f"# {note}"] if note is not None else []
    lines += [f"# {muon_split(cfg)}"] if cfg.train.optimizer == "muon" else []
    lines += ["", "# plan"] + (
        describe_prediction(pred) if pred is not None else ["async: not predicted"]
    )
    return lines
