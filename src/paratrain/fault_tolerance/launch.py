"""`paratrain train --fault-tolerance`: the coordinator in this process, one elastic agent
per replica group (group_agent.py), and the run's record made from the groups' once they
are done: the metrics and summary of the group that trained the most steps, and what the
protocol did (rounds, aborts, each group's exit, the samples its absences dropped)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from paratrain.config import RunConfig
from paratrain.fault_tolerance.coordinator import Coordinator
from paratrain.fault_tolerance.group_env import COORDINATOR_VAR
from paratrain.fault_tolerance.quorum import coordinator_address, samples
from paratrain.fault_tolerance.record import (
    QUORUM_FILE,
    Script,
    effective_rounds,
    ft_data_of,
    read_lines,
)
from paratrain.fault_tolerance.worker import group_dir
from paratrain.launch import SHUTDOWN_TIMEOUT_S, WORKER_FLAG, WorkersFailed
from paratrain.train import run_dir as rd


def start_coordinator(cfg: RunConfig, run_dir: Path, host: str, port: int) -> Coordinator:
    p = cfg.parallel
    script = Script(Path(p.replay_quorum)) if p.replay_quorum else None
    return Coordinator(
        p.replicas,
        p.min_replicas,
        p.heartbeat_timeout_s,
        run_dir / QUORUM_FILE,
        cfg.train.global_batch,
        ft_data_of(p.replay_quorum, p.ft_data),
        script,
        host,
        port,
    )


def serve_groups(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """--coordinator HOST:PORT without torchrun: the coordinator alone, for replica groups
    that torchrun starts (on other machines); the run's record once every group is gone.
    RUN_DIR is where every group writes too: a filesystem they share."""
    p = cfg.parallel
    host, port = coordinator_address(p.coordinator)
    coordinator = start_coordinator(cfg, run_dir, host, port)
    print(
        f"fault tolerance: coordinator at {coordinator.address}; start each replica group G "
        f"(0 to {p.replicas - 1}, {p.nproc // p.replicas} ranks each) as its own torchrun job: "
        "torchrun <its nodes and ranks> -m paratrain train <the flags given here> --ft-group G "
        f"--coordinator {coordinator.address}",
        flush=True,
    )
    started = time.time()
    try:  # in short waits: a stop signal to this process is handled at once
        while not coordinator.done.wait(0.2):
            continue
    finally:
        coordinator.close()
    summaries = [group_dir(run_dir, g) / rd.SUMMARY_FILE for g in range(p.replicas)]
    # A group finished if it wrote its summary in this run (a resumed run has older ones)
    finished = [s.is_file() and s.stat().st_mtime >= started for s in summaries]
    return run_record(cfg, run_dir, {g: 0 if done else None for g, done in enumerate(finished)})


def launch_groups(cfg: RunConfig, config_path: Path, run_dir: Path) -> dict[str, Any]:
    p = cfg.parallel
    coordinator = start_coordinator(cfg, run_dir, "127.0.0.1", 0)
    env = os.environ | {COORDINATOR_VAR: coordinator.address}
    workers = ["train", "--config", str(config_path), WORKER_FLAG]
    agents = {
        g: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paratrain.fault_tolerance.group_agent",
                str(g),
                str(p.nproc // p.replicas),
                str(p.max_restarts),
                *workers,
            ],  # fmt: skip
            env=env,
        )
        for g in range(p.replicas)
    }
    exits: dict[int, int | None] = {}
    try:
        while len(exits) < len(agents):
            for g, agent in agents.items():
                if g not in exits and agent.poll() is not None:
                    exits[g] = agent.returncode
                    coordinator.agent_exited(g)
            time.sleep(0.05)
    except SignalException as e:
        # A stop: the agents pass it on; each group finishes its step and the saver of the
        # last round saves (train/preemption.py), with the coordinator still up for them.
        # A second signal ends them at once (below).
        for agent in agents.values():
            if agent.poll() is None:
                agent.send_signal(e.sigval)
        for agent in agents.values():
            agent.wait(SHUTDOWN_TIMEOUT_S)
        raise
    finally:  # a second signal, or an error here: the agents pass it on to their workers
        for agent in agents.values():
            if agent.poll() is None:
                agent.terminate()
        for agent in agents.values():
            agent.wait(SHUTDOWN_TIMEOUT_S)
        coordinator.close()
    return run_record(cfg, run_dir, exits)


def run_record(cfg: RunConfig, run_dir: Path, exits: dict[int, int | None]) -> dict[str, Any]:
    """The run's metrics and summary from its groups'; WorkersFailed if no group finished.
    exits: each group's exit status; None where it is not known (torchrun's, elsewhere)."""
    finished = []
    for g in sorted(exits):
        path = group_dir(run_dir, g) / rd.SUMMARY_FILE
        if exits[g] == 0 and path.is_file():
            finished.append(json.loads(path.read_text()))
    if not finished:
        failed = ", ".join(f"group {g} exit {code}" for g, code in sorted(exits.items()))
        codes = [code for code in exits.values() if code is not None]
        raise WorkersFailed(f"no replica group finished ({failed})", max(codes, default=1) or 1)
    best = max(finished, key=lambda s: (s["steps"], -s["group"]))
    shutil.copyfile(group_dir(run_dir, best["group"]) / rd.METRICS_FILE, run_dir / rd.METRICS_FILE)
    summary = dict(best) | {"run_dir": str(run_dir), "world_size": cfg.world_size}
    summary["fault_tolerance"] = protocol_record(cfg, run_dir, exits)
    rd.write_summary(run_dir, summary)
    rd.write_loss_plot(run_dir, rd.read_step_metrics(run_dir), summary["val_loss"])
    return summary


def protocol_record(cfg: RunConfig, run_dir: Path, exits: dict[int, int | None]) -> dict[str, Any]:
    """Rounds, commits, each group's exit status, and the samples that committed steps
    trained and dropped (under --ft-data drop, the slices of groups out of a round)."""
    lines = read_lines(run_dir / QUORUM_FILE)
    rounds = [line for line in lines if "committed" in line]
    committed = effective_rounds(lines)  # those that made the state
    trained = [tuple(s) for r in committed for s in r["samples"].values()]
    sizes = [hi - lo for lo, hi in trained]
    dropped = dropped_slices(cfg, committed)
    return {
        "rounds": len(rounds),
        "committed": len(committed),
        "aborted": sum(not r["committed"] for r in rounds),
        "rewinds": [line["rewind"] + 1 for line in lines if "rewind" in line],  # to step
        "group_exits": {str(g): code for g, code in sorted(exits.items())},
        "ft_data": committed[0]["ft_data"] if committed else cfg.parallel.ft_data,
        "trained_samples": sum(sizes),
        "reused_samples": sum(sizes) - sum(hi - lo for lo, hi in set(trained)),
        "dropped_samples": sum(hi - lo for *_, lo, hi in dropped),
        "dropped": dropped,  # [step, group, lo, hi): the step and group the slice was for
        "quorum_log": str(run_dir / QUORUM_FILE),
    }


def dropped_slices(cfg: RunConfig, committed: list[dict[str, Any]]) -> list[list[int]]:
    """The stream's slices that no committed round trained, up to where the rounds took
    the stream: the end of the last step's batch (drop), or the last slice trained
    (replay, which trains the slices in order: none is dropped)."""
    p, batch = cfg.parallel, cfg.train.global_batch
    if not committed:
        return []
    per_group = batch // p.replicas
    trained = {lo // per_group for r in committed for lo, _ in r["samples"].values()}
    if committed[0]["ft_data"] == "replay":
        end = max(trained) + 1
    else:
        end = (max(r["step"] for r in committed) + 1) * p.replicas
    return [
        [slot // p.replicas + 1, slot % p.replicas, *samples(slot, batch, p.replicas)]
        for slot in range(end)
        if slot not in trained
    ]


def protocol_line(ft: dict[str, Any]) -> str:
    exits = ", ".join(f"group {g} exit {c}" for g, c in ft["group_exits"].items() if c)
    return (
        f"fault tolerance: {ft['committed']} steps committed in {ft['rounds']} rounds "
        f"({ft['aborted']} aborted); {ft['trained_samples']} samples trained, "
        f"{ft['dropped_samples']} dropped (--ft-data {ft['ft_data']})"
        + (f"; {exits}" if exits else "")
        + "".join(
            f"; every group started again at step {s}, from a checkpoint" for s in ft["rewinds"]
        )
        + f"; rounds in {ft['quorum_log']}"
    )
