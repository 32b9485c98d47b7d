"""`paratrain train` without torchrun: make the run directory, start the workers (or train
in this process with --nproc 1), and say how it ended: the summary, why it failed, or what
stopped it and how to go on.

Stop signals (SIGTERM from a scheduler, SIGINT from Ctrl-C) raise SignalException here
from the start, as they do once the elastic agent runs (it passes them on to the workers,
which finish their step and save, train/preemption.py); so a signal at any moment ends in
the same one line, and a start that saved nothing leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from paratrain.config import RunConfig

log = logging.getLogger("paratrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOPPED_EXIT = 143  # 128 + SIGTERM, what a scheduler expects from a terminated job


def launch_and_report(cfg: RunConfig, as_json: bool) -> int:
    from paratrain.launch import WorkersFailed
    from paratrain.train import run_dir as rd
    from paratrain.train.failed_start import before_start, undo_failed_start

    fresh = not cfg.train.resume
    if fresh:
        run_dir = rd.prepare_run_dir(cfg.train.out)
    else:
        run_dir = rd.check_writable(Path(cfg.train.resume), "--resume")
    before = before_start(run_dir, fresh)
    with signals_raise():
        try:
            summary = _start(cfg, run_dir, fresh)
        except WorkersFailed as e:
            log.error("paratrain: %s; %s", e, undo_failed_start(before))
            return 2 if e.exitcode == 2 else 1  # a user error stays one
        except SignalException as e:  # to this process; the agent passed it on
            return stopped_by_signal(run_dir, before, e.sigval.name)
        except BaseException:
            undo_failed_start(before)
            raise
    if "stopped_at_step" in summary:  # a signal to the workers, or to this one process
        return report_stopped(run_dir, before, summary.get("stopped_by"))
    print_summary(summary, as_json)
    return 0


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


def _count(n: int, noun: str) -> str:
    """ "1 process", "2 processes": the plural a count needs."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    print(
        f"trained {_count(summary['steps'], 'step')} on "
        f"{_count(summary['world_size'], 'process')}: "
        f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"validation {summary['val_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s; "
        f"run directory {summary['run_dir']}",
        flush=True,
    )
    peaks = summary.get("cuda_max_allocated_bytes")
    if peaks:  # on CUDA: what the allocator held at most, beside the model state counted
        state = summary.get("model_state_bytes_per_rank") or [None] * len(peaks)
        print(
            "CUDA memory per rank (max allocated / model state): "
            + ", ".join(
                f"{p / 2**30:.2f} / {_gib(s)} GiB" for p, s in zip(peaks, state, strict=True)
            ),
            flush=True,
        )
    if "fault_tolerance" in summary:
        from paratrain.fault_tolerance.launch import protocol_line

        print(protocol_line(summary["fault_tolerance"]), flush=True)
    if as_json:
        print(json.dumps(summary), flush=True)


def _start(cfg: RunConfig, run_dir: Path, fresh: bool) -> dict[str, Any]:
    """Write the config, train, and return the summary."""
    from paratrain.launch import launch_local
    from paratrain.train import run_dir as rd
    from paratrain.train.provenance import record_start, user_command
    from paratrain.train.worker import WorkerEnv, run_worker

    if not fresh:
        rd.keep_previous_config(run_dir)
    cfg.train.out = str(run_dir)
    config_path = rd.write_config(run_dir, cfg)
    record_start(run_dir, user_command())  # the workers' command line is the launcher's
    if cfg.parallel.fault_tolerance:  # one agent per replica group, and the coordinator
        from paratrain.fault_tolerance.launch import launch_groups, serve_groups

        if cfg.parallel.coordinator:  # the groups are torchrun's, elsewhere
            return serve_groups(cfg, run_dir)
        return launch_groups(cfg, config_path, run_dir)
    if cfg.parallel.nproc == 1:  # the same worker code, in this process
        summary = run_worker(cfg, WorkerEnv(0, 1, 0, 1, use_env_rendezvous=False), True)
        assert summary is not None
        return summary
    launch_local(cfg.parallel.nproc, config_path, max_restarts=cfg.parallel.max_restarts)
    return rd.read_summary(run_dir)


def _raise_signal(signum: int, frame: Any) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"got {sigval.name}", sigval=sigval)


@contextmanager
def signals_raise() -> Iterator[None]:
    previous = {sig: signal.signal(sig, _raise_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is not signal.SIG_IGN:  # stopped: stay so
                signal.signal(sig, handler)


def stopped_by_signal(run_dir: Path, before: Any, signal_name: str) -> int:
    """Report a stop signal to this process, then exit; further stop signals are ignored
    from here on. The workers are gone, so there is nothing left for them to stop, while
    they could land as the agent's objects are freed (its rendezvous timers join their
    threads in finalizers: a traceback printed and ignored), amid deleting a failed
    start's files, or once Python's exit has put the default handlers back (killed by
    the signal, not exit status 128 + it)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    return report_stopped(run_dir, before, signal_name)


def report_stopped(run_dir: Path, before: Any, signal_name: str | None) -> int:
    """One line: what stopped the run, what it saved, and a command that continues it (only
    when there is a checkpoint to continue from); the exit status is 128 + the signal.
    before: what failed_start noted before the start, None under torchrun."""
    from paratrain.checkpoint import latest_checkpoint
    from paratrain.train.failed_start import undo_failed_start

    why = {"SIGINT": "Ctrl-C (SIGINT)", None: "a signal to another rank"}.get(signal_name)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None and before is None:  # under torchrun: nothing to undo here
        saved = "no checkpoint was saved"
    elif ckpt is None:  # stopped before its first checkpoint: as a start that failed
        saved = undo_failed_start(before)
    else:  # under torchrun our launcher cannot continue it: the user's torchrun can
        resume = f"paratrain train --resume {run_dir}"
        how = f"`{resume}`" if before is not None else f"torchrun again and `-m {resume}`"
        saved = f"checkpoint of step {ckpt.step} in {ckpt.path}; continue with {how}"
    # On a terminal, a bar that a second signal left unfinished is cleared first.
    clear = "\r\x1b[K" if sys.stderr.isatty() else ""
    line = f"{clear}paratrain train: stopped by {why or signal_name}; {saved}"
    print(line, file=sys.stderr, flush=True)
    return 128 + signal.Signals[signal_name] if signal_name else STOPPED_EXIT
