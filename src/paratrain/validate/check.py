"""Every check on user input, in order: the fields' own facts, then the combination rules
of each concern (rules_*.py). The CLI runs `resolve_and_check` before any worker starts."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import RunConfig, resolve
from paratrain.machine import cuda_available
from paratrain.validate.field_checks import check_fields
from paratrain.validate.rules_compile import compile_rules
from paratrain.validate.rules_data import data_rules
from paratrain.validate.rules_devices import device_rules, dtype_rules
from paratrain.validate.rules_experts import experts_rules
from paratrain.validate.rules_layout import batch_rules, mesh_rules, straggler_rules
from paratrain.validate.rules_model import model_rules
from paratrain.validate.rules_optimizer import optimizer_rules
from paratrain.validate.rules_pipeline import pipeline_rules
from paratrain.validate.rules_sharding import (
    context_parallel_rules,
    hsdp_rules,
    tensor_parallel_rules,
    zero_rules,
)

# The rules after the mesh's, in the order their refusals are reported: each may rely on
# the ones before (the batch on a whole dp, the schedule on a whole K). The experts' come
# before the batch's so that an ep that cannot split the experts is named first.
RULES: tuple[Callable[[RunConfig], None], ...] = (
    dtype_rules,
    experts_rules,
    straggler_rules,
    batch_rules,
    pipeline_rules,
    model_rules,
    tensor_parallel_rules,
    context_parallel_rules,
    zero_rules,
    hsdp_rules,
    compile_rules,
    optimizer_rules,
    data_rules,
)


def check(cfg: RunConfig, world_size: int, local_procs: int | None = None) -> None:
    """Refuse a resolved configuration (config.resolve) that cannot run on `world_size`
    ranks: a ValueError whose one line names the flag and what would be valid.

    local_procs: ranks on this node (torchrun's LOCAL_WORLD_SIZE); default --nproc.
    """
    assert cfg.parallel.device != "auto", "check a resolved configuration (config.resolve)"
    check_fields(cfg)
    device_rules(cfg, local_procs or cfg.parallel.nproc)
    mesh_rules(cfg, world_size)
    for rule in RULES:
        rule(cfg)


def resolve_and_check(cfg: RunConfig, world_size: int, local_procs: int | None = None) -> RunConfig:
    """The configuration a run starts from: `cfg` resolved (a copy) and checked."""
    check_fields(cfg)  # first as given: these need no torch
    resolved = resolve(cfg, world_size, cuda_available())  # torch only where a driver is
    check(resolved, world_size, local_procs)
    return resolved
