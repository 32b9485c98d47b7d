"""The work of `paratrain eval RUN [--data D] [--nproc N --tp T --pp P --zero Z --device D]`.

With the default layout it scores in this process (trained/run_model.py); otherwise the
layout is checked as `train` checks one, the data before any worker starts, and N
workers are launched (or this is one of them, under torchrun), each evaluating its part
(trained/mesh_eval.py). Only one process prints the scores.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from paratrain.config import RunConfig
from paratrain.trained.run_model import eval_seq_len, eval_tokens, load_config
from paratrain.validate import resolve_and_check

log = logging.getLogger(__name__)

LAYOUT_FLAGS = ("nproc", "tp", "pp", "zero", "device")
DEFAULT_LAYOUT = {"nproc": 1, "tp": 1, "pp": 1, "zero": 0, "device": "auto"}


def mesh_config(run_dir: Path, layout: dict[str, Any]) -> RunConfig:
    """The run's model on the layout given (checked as `train` checks one); one
    micro-batch of the run's size per pipeline stage per pass."""
    cfg = copy.deepcopy(load_config(run_dir))
    p, t = cfg.parallel, cfg.train
    for name in LAYOUT_FLAGS:
        setattr(p, name, layout[name])
    p.dp, p.backend, p.chunks, p.schedule, p.dp_mode = 0, "auto", 1, "1f1b", "sync"
    p.cp = 1  # whole sequences: evaluation has no cp flag (a cp run is evaluated as any)
    p.straggler, p.max_restarts, p.sequence_parallel = "", 0, p.sequence_parallel and p.tp > 1
    t.init_from, t.resume = "", ""
    dp = p.nproc // max(1, p.tp * p.pp)
    t.global_batch, t.microbatches = t.micro_batch * dp * p.pp, 0
    return resolve_and_check(cfg, p.nproc)


def evaluate_run(args: Any) -> int:
    """`paratrain eval`: in this process (--nproc 1), or in N workers started here, or as
    one of them (torchrun's environment). Prints the scores from one process only."""
    from paratrain.launch import torchrun_env

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{args.run_dir!r} is not a directory; give a paratrain run directory")
    layout = {name: getattr(args, name) for name in LAYOUT_FLAGS}
    env = torchrun_env()
    if env is not None:
        return _as_worker(args, run_dir, layout, env)
    if layout == DEFAULT_LAYOUT:
        from paratrain.trained.run_model import evaluate_file

        print_scores(evaluate_file(run_dir, args.data, args.seq_len), args.json)
        return 0
    cfg = mesh_config(run_dir, layout)
    eval_seq_len(cfg, args.seq_len)  # before launch: the window and the data fit the model
    eval_tokens(cfg, run_dir, args.data)
    return _launch(args, run_dir, layout)


def _launch(args: Any, run_dir: Path, layout: dict[str, Any]) -> int:
    from paratrain.launch import WorkersFailed, launch_workers

    argv = ["eval", str(run_dir)] + (["--data", args.data] if args.data else [])
    argv += ["--seq-len", str(args.seq_len)] if args.seq_len else []
    argv += ["--json"] if args.json else []
    for name, value in layout.items():
        argv += [f"--{name}", str(value)]
    try:
        launch_workers(layout["nproc"], argv)
    except WorkersFailed as e:
        log.error("paratrain eval: %s", e)
        return 2 if e.exitcode == 2 else 1
    return 0


def _as_worker(args: Any, run_dir: Path, layout: dict[str, Any], env: dict[str, Any]) -> int:
    from paratrain.train.failure import run_then_exit
    from paratrain.train.worker import WorkerEnv
    from paratrain.trained.mesh_eval import evaluate_on_mesh

    def work() -> None:
        cfg = mesh_config(run_dir, layout | {"nproc": env["world_size"]})
        worker_env = WorkerEnv(use_env_rendezvous=True, **env)
        result = evaluate_on_mesh(cfg, worker_env, run_dir, args.data, args.seq_len)
        if result is not None:
            print_scores(result, args.json)

    run_then_exit(work, env, "eval")


def print_scores(result: dict[str, float], as_json: bool) -> None:
    print(
        f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
        f"{result['tokens']:,} tokens",
        flush=True,
    )
    if as_json:
        print(json.dumps(result), flush=True)
