"""The parallel section of a run's configuration: the fields of parallel_fields.py, then
fault tolerance's across replica groups (fault_tolerance/, docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.choices import FT_DATA
from paratrain.config.conditions import FAULT_GROUPS, FAULT_TOLERANCE
from paratrain.config.fields import param
from paratrain.config.parallel_fields import ParallelFields


@dataclass
class ParallelConfig(ParallelFields):
    fault_tolerance: bool = param(
        False,
        "Per-step fault tolerance across the replica groups: each step commits over the"
        " groups alive (a quorum), a failed group is dropped without a restart and a"
        " relaunched one copies the state from a live peer (docs/reliability.md).",
        effect=FAULT_GROUPS,
    )
    min_replicas: int = param(
        2,
        "Fault tolerance: replica groups a step needs to commit (a group alone never does).",
        at_least=1,
        effect=FAULT_TOLERANCE,
    )
    heartbeat_timeout_s: float = param(
        5.0,
        "Fault tolerance: a group silent this long is dropped from the next quorum.",
        above=0,
        effect=FAULT_TOLERANCE,
    )
    ft_data: str = param(
        "drop",
        "Fault tolerance: what becomes of the samples of a group out of a round: drop them"
        " (each step trains its own batch), or replay them (each round trains the next"
        " samples not yet trained, so none is lost).",
        choices=FT_DATA,
        effect=FAULT_TOLERANCE,
    )
    inject_fault: str = param(
        "",
        "Fault tolerance: faults to inject, KIND:GROUP:STEP[,...] (repeatable); KIND kill"
        " (the group's workers exit before their backward), hang (it holds its cross-group"
        " reduction for two --comm-timeout-s) or allreduce-error (its reduction fails once).",
        default_means="none",
        repeatable=True,
        effect=FAULT_TOLERANCE,
    )
    coordinator: str = param(
        "",
        "Fault tolerance across machines: HOST:PORT of the coordinator. Without torchrun,"
        " this process runs only the coordinator there (port 0: a free one, printed) and"
        " waits for the replica groups; under torchrun, a group's workers reach it there.",
        default_means="none: the launcher runs it beside the groups",
        effect=FAULT_TOLERANCE,
    )
    ft_group: int = param(
        -1,
        "Fault tolerance under torchrun: the replica group this job is, 0 to --replicas - 1"
        " (each group its own torchrun job, pointed at --coordinator).",
        default_means="none",
        effect=FAULT_TOLERANCE,
    )
    replay_quorum: str = param(
        "",
        "Train the committed steps of a fault-tolerant run's RUN_DIR/quorum.jsonl again,"
        " without failures: the same participants and samples per step.",
        default_means="none",
        effect=FAULT_TOLERANCE,
    )
