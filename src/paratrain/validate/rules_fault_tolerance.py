"""Rules on --fault-tolerance (fault_tolerance/): replica groups to survive in, the faults
asked for, a replay's record, and what it does not combine with yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.config import RunConfig
from paratrain.config.choices import FT_DATA
from paratrain.fault_tolerance.quorum import coordinator_address, parse_faults
from paratrain.fault_tolerance.record import QUORUM_FILE, effective_rounds, read_lines


def fault_tolerance_rules(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if not p.fault_tolerance:
        return
    if p.replicas < 2:
        raise ValueError(
            "--fault-tolerance needs replica groups to survive in: --replicas 2 or more "
            "(with --zero 1, 2 or 3)"
        )
    if p.min_replicas > p.replicas:
        raise ValueError(
            f"--min-replicas {p.min_replicas} is above --replicas {p.replicas}; "
            f"valid: 1 to {p.replicas}"
        )
    unsupported = [
        (bool(p.straggler), "--straggler", "no --straggler"),
        # each group balances by its own batch's loads: the groups' biases would differ
        (cfg.model.bias_rate > 0, f"--bias-rate {cfg.model.bias_rate}", "--bias-rate 0"),
    ]
    for refused, given, instead in unsupported:
        if refused:
            raise ValueError(f"--fault-tolerance with {given} is not supported yet; use {instead}")
    parse_faults(p.inject_fault, p.replicas, t.steps)
    if p.coordinator:
        coordinator_address(p.coordinator)
    if not -1 <= p.ft_group < p.replicas:
        raise ValueError(f"--ft-group {p.ft_group}: valid: 0 to {p.replicas - 1}")
    if t.resume and (Path(t.resume) / QUORUM_FILE).is_file():
        record = Path(t.resume) / QUORUM_FILE
        rounds = recorded_rounds(record, f"--resume {t.resume!r}: its {QUORUM_FILE}", cfg)
        if rounds and rounds[0]["ft_data"] != p.ft_data:
            raise ValueError(
                f"--resume {t.resume!r}: its rounds assigned samples by --ft-data "
                f"{rounds[0]['ft_data']}; resume it with that, not --ft-data {p.ft_data}"
            )
    if p.replay_quorum:
        if t.resume:
            raise ValueError("--replay-quorum trains from the first step: drop --resume")
        if p.inject_fault:
            raise ValueError("--replay-quorum trains without failures: drop --inject-fault")
        if p.ft_data != "drop":
            raise ValueError(
                f"--replay-quorum trains the samples its record names: drop --ft-data {p.ft_data}"
            )
        check_record(Path(p.replay_quorum), cfg)


def check_record(path: Path, cfg: RunConfig) -> None:
    """A quorum.jsonl that a replay can train from the start: its rounds fit this layout
    (`recorded_rounds`), and its effective rounds are steps 1, 2, ... in order."""
    flag = f"--replay-quorum {str(path)!r}"
    rounds = recorded_rounds(path, flag, cfg)
    if not rounds:
        raise ValueError(f"{flag}: no committed round to replay")
    for due, r in enumerate(rounds):
        if r["step"] != due:
            raise ValueError(
                f"{flag}: round {r.get('round')} computes step {r['step'] + 1} where step "
                f"{due + 1} is due (a run resumed from a checkpoint of a run without fault "
                "tolerance?): a replay trains every step from the first"
            )


def recorded_rounds(path: Path, flag: str, cfg: RunConfig) -> list[dict[str, Any]]:
    """The effective rounds of a quorum.jsonl, checked: its groups exist, its steps are
    within --steps, and its samples are slices of this layout's stream."""
    p, t = cfg.parallel, cfg.train
    try:
        lines = read_lines(path)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read it ({e.strerror})") from None
    except ValueError:
        raise ValueError(f"{flag}: not a quorum.jsonl (a JSON object per line)") from None
    try:
        rounds = effective_rounds(lines)
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{flag}: not a quorum.jsonl (rounds and rewinds)") from None
    for r in rounds:
        try:
            step, groups, used, mode = r["step"], r["participants"], r["samples"], r["ft_data"]
        except KeyError as e:
            raise ValueError(f"{flag}: round without {e}: not a quorum.jsonl") from None
        if mode != rounds[0]["ft_data"] or mode not in FT_DATA:
            raise ValueError(
                f"{flag}: round {r.get('round')} has ft_data {mode!r}: not a quorum.jsonl"
            )
        if not 0 <= step < t.steps or any(not 0 <= g < p.replicas for g in groups):
            raise ValueError(
                f"{flag}: round {r.get('round')} (step {step + 1}, groups {groups}) does not "
                f"fit this run's --steps {t.steps} and --replicas {p.replicas}"
            )
        per_group = t.global_batch // p.replicas
        for g in groups:
            lo, hi = used.get(str(g)) or (0, 0)
            if hi - lo != per_group or lo % per_group:
                raise ValueError(
                    f"{flag}: round {r.get('round')} gave group {g} samples {used.get(str(g))}, "
                    f"not a slice of this run's stream ({per_group} samples from a multiple of "
                    f"{per_group}): it was recorded with another --global-batch or --replicas"
                )
    return rounds


def check_torchrun_group(cfg: RunConfig, under_torchrun: bool, our_groups: bool) -> None:
    """A replica group started by a user's torchrun says which it is and where its
    coordinator is; --ft-group means nothing to our launcher, which numbers its own.
    our_groups: the worker of a group our launcher started (it was told both)."""
    p = cfg.parallel
    if not p.fault_tolerance or our_groups:
        return
    if not under_torchrun and p.ft_group >= 0:
        raise ValueError(
            f"--ft-group {p.ft_group} is for a replica group started by torchrun; without "
            "it the launcher starts and numbers every group: drop --ft-group"
        )
    if under_torchrun and (p.ft_group < 0 or not p.coordinator):
        raise ValueError(
            "--fault-tolerance under torchrun: each replica group is its own torchrun job; "
            "give it --ft-group G and --coordinator HOST:PORT (docs/reliability.md)"
        )
    if under_torchrun and coordinator_address(p.coordinator)[1] == 0:
        raise ValueError(f"--coordinator {p.coordinator!r}: give the port the coordinator printed")
