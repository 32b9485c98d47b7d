"""Every layout of the combination grid that a test trains (scripts/combination_coverage.py)
trains under NCCL's order with the same losses, gradient norms and parameters, bitwise, as
under gloo's (issue 28). The order only delays calls, each to its stream's turn; the same
calls carry the same tensors, so any difference is a defect, and rounding is no excuse.

Each layout is `paratrain train`'s configuration for its modes (combination_table.command,
through the CLI's parser and checks), trained for one step through the loop that the
workers run, once under each order in the same processes; layouts of one world size
share one launch. Three modes are the layout without them here: resume and restarts
restart the same training (their tests compare that with the uninterrupted run, under
NCCL's order), and compile changes no call (its inductor build costs tens of seconds a
layout; test_compile.py trains it under NCCL's order).
"""

from __future__ import annotations

import functools
import math
import textwrap

import pytest
import torch
from scripts import combination_table as table
from scripts.combination_coverage import COVERAGE

from tests.distributed import run_distributed
from tests.equivalence import tiny_data

SAME_TRAINING = {"resume", "restarts", "compile"}  # see the docstring
STEPS = 1  # its loss, gradient norm and the parameters after it: every call of a step


@functools.cache
def grid_layouts() -> dict[int, list[tuple[str, ...]]]:
    """world size -> the distinct layouts the grid's tests train, as sorted mode keys."""
    layouts = {
        tuple(sorted(modes - SAME_TRAINING))
        for sets in COVERAGE.values()
        for modes in sets
        if len(modes - SAME_TRAINING) > 0
    }
    by_world: dict[int, list[tuple[str, ...]]] = {}
    for modes in sorted(layouts):
        cfg = layout_config(modes)
        by_world.setdefault(cfg.parallel.nproc, []).append(modes)
    return by_world


def layout_config(modes: tuple[str, ...]):
    """`paratrain train`'s resolved configuration for these modes (combination_table's
    command), checked as the command checks it, for STEPS steps without validation."""
    from paratrain import cli
    from paratrain.commands.config_flags import config_from_args, explicit_fields
    from paratrain.validate import check_effective, resolve_and_check

    argv = [a.replace("{dir}/text.txt", textwrap.__file__) for a in table.command(modes)]
    argv = ["train", *argv, "--steps", str(STEPS), "--seq-len", "16", "--val-batches", "0"]
    if "fp16" in modes:  # so the step is taken: at 2**16 (the default) and at 1024 some
        argv += ["--loss-scale", "1"]  # gradient entry of this model overflows float16
    args = cli.build_parser().parse_args(argv)
    cfg = resolve_and_check(config_from_args(args), int(args.__dict__["parallel.nproc"]))
    # Two micro-batches per replica and stage (a pipeline's whole schedule runs): smaller
    # than the command's 16, as a test of the order needs no more.
    p, t = cfg.parallel, cfg.train
    batch = t.micro_batch * p.dp * 2 * p.pp
    args = cli.build_parser().parse_args([*argv, "--global-batch", str(batch)])
    cfg = resolve_and_check(config_from_args(args), p.nproc)
    check_effective(cfg, explicit_fields(args))
    m = cfg.model  # smaller than the presets (the order is what is tested): 4 heads of 8
    m.d_model, m.n_layer = 32, max(2, cfg.parallel.pp * cfg.parallel.chunks)
    m.ffn_hidden = 64 if m.arch == "llama" else m.ffn_hidden
    return cfg


def train_both_orders(rank, world_size, configs, data) -> list[tuple[list, list, bool]]:
    """Each config trained under gloo's order, then NCCL's: this rank's (losses, norms)
    under each, and whether its parameters ended bitwise equal."""
    from paratrain.comm import CommOptions
    from paratrain.mesh import Mesh
    from paratrain.train.async_loop import train_async
    from paratrain.train.loop import train

    out = []
    for cfg in configs:
        p, runs = cfg.parallel, []
        for order in ("gloo", "nccl"):
            options = CommOptions(algo=p.comm_algo, order=order)
            mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep, options=options)
            run = train_async if p.dp_mode == "async" else train
            result = run(cfg, mesh, data)
            chunks = result.model if hasattr(result.model, "__len__") else [result.model]
            state = [t.detach().clone() for c in chunks for t in c.state_dict().values()]
            metrics = [(m.loss, m.grad_norm) for m in result.metrics]
            runs.append((metrics, state))
            mesh.close()
        (gloo, gloo_state), (nccl, nccl_state) = runs
        same = len(gloo_state) == len(nccl_state) and all(
            torch.equal(a, b) for a, b in zip(gloo_state, nccl_state, strict=True)
        )
        out.append((gloo, nccl, same))
    return out


WORLDS = (2, 4, 8)  # the grid's world sizes (checked below)


# World 2 is in the equivalence subset, run on every supported torch (Makefile). World 4's
# 52 layouts, twice each, took 90-150 s alone and over 300 s beside two other test files.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.equivalence), 4, 8])
def test_grid_layouts_train_bitwise_the_same_under_both_orders(world):
    layouts = grid_layouts()[world]
    configs = [layout_config(modes) for modes in layouts]
    data = tiny_data()
    per_rank = run_distributed(train_both_orders, world, configs, data, order="gloo", timeout=900)
    for i, modes in enumerate(layouts):
        reported = [results[i][0] for results in per_rank if results[i][0]]
        assert reported and all(len(r) == STEPS for r in reported), (modes, reported)
        taken = all(math.isfinite(norm) for r in reported for _, norm in r)
        assert taken, f"{modes}: a step was skipped, so it compared no gradients: {reported}"
        for rank, results in enumerate(per_rank):  # an asynchronous server reports no steps
            gloo, nccl, same = results[i]
            assert gloo == nccl, f"{modes} rank {rank}: gloo's order {gloo}, NCCL's {nccl}"
            assert same, f"{modes} rank {rank}: parameters differ between the orders"


def test_the_grid_layouts_cover_every_mode_that_trains():
    """The layouts above are the grid's: every mode a test trains is in one of them."""
    layouts = grid_layouts()
    trained = {m for sets in COVERAGE.values() for modes in sets for m in modes}
    here = {m for world in layouts.values() for modes in world for m in modes}
    assert trained - SAME_TRAINING == here
    assert tuple(sorted(layouts)) == WORLDS
    assert sum(len(v) for v in layouts.values()) > 100
