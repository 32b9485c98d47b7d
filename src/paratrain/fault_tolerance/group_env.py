"""Which replica group a worker belongs to, and where the coordinator is: the environment
the launcher (or a user's torchrun per group) gives it. No torch here: the CLI reads it
before deciding what to load."""

from __future__ import annotations

import os
from dataclasses import dataclass

GROUP_VAR = "PARATRAIN_FT_GROUP"  # which replica group this job is
COORDINATOR_VAR = "PARATRAIN_FT_COORDINATOR"  # HOST:PORT of the coordinator's store


@dataclass(frozen=True)
class GroupEnv:
    group: int
    coordinator: str


def group_env(ft_group: int = -1, coordinator: str = "") -> GroupEnv | None:
    """Our launcher's group (the environment), else a user's torchrun job's (--ft-group and
    --coordinator), else None: not a replica group's worker."""
    if GROUP_VAR in os.environ:
        return GroupEnv(int(os.environ[GROUP_VAR]), os.environ[COORDINATOR_VAR])
    return GroupEnv(ft_group, coordinator) if ft_group >= 0 else None
