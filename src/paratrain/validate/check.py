"""Every check on user input, in order: the fields' own facts, then the combination rules
of each concern (rules_*.py). The CLI runs `resolve_and_check` before any worker starts."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import RunConfig, resolve
from paratrain.machine import cuda_available, cuda_known
from paratrain.validate.effective import check_effective
from paratrain.validate.field_checks import check_fields
from paratrain.validate.rules_compile import compile_rules
from paratrain.validate.rules_compression import compression_rules
from paratrain.validate.rules_data import data_rules
from paratrain.validate.rules_devices import device_rules, dtype_rules
from paratrain.validate.rules_diloco import diloco_rules
from paratrain.validate.rules_experts import experts_rules
from paratrain.validate.rules_fault_tolerance import fault_tolerance_rules
from paratrain.validate.rules_layout import batch_rules, mesh_rules, straggler_rules
from paratrain.validate.rules_lora import lora_rules
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
    compression_rules,
    fault_tolerance_rules,
    diloco_rules,
    compile_rules,
    optimizer_rules,
    lora_rules,
    data_rules,
)


def check(
    cfg: RunConfig, world_size: int, local_procs: int | None = None, count_gpus: bool = True
) -> None:
    """Refuse a resolved configuration (config.resolve) that cannot run on `world_size`
    ranks: a ValueError whose one line names the flag and what would be valid.

    local_procs: ranks on this node (torchrun's LOCAL_WORLD_SIZE); default --nproc.
    count_gpus False: leave out the one rule that loads torch (a candidate device).
    """
    assert cfg.parallel.device != "auto", "check a resolved configuration (config.resolve)"
    check_fields(cfg)
    device_rules(cfg, local_procs or cfg.parallel.nproc, count_gpus)
    mesh_rules(cfg, world_size)
    for rule in RULES:
        rule(cfg)


def resolve_and_check(
    cfg: RunConfig,
    world_size: int,
    local_procs: int | None = None,
    given: dict[str, str] | None = None,
    device_free: Callable[[RunConfig], None] | None = None,
) -> RunConfig:
    """The configuration a run starts from: `cfg` resolved (a copy) and checked. given: the
    fields given explicitly (check_effective's); device_free: the caller's further checks
    that need no torch and hold on either device (the data's), run once, on a passing
    configuration.

    Where only torch can say what `--device auto` means (a GPU driver is here, torch not
    yet loaded: seconds), both answers are checked first, without torch: a refusal they
    share is this machine's, and `device_free` runs before torch is asked.
    """
    check_fields(cfg)  # first as given: these need no torch
    cuda, passed = cuda_known(), None
    if cuda is None:
        passed = _on_either_device(cfg, world_size, local_procs, given)
        if passed is not None and device_free is not None:
            device_free(passed)
        cuda = cuda_available()
    resolved = _resolved_and_checked(cfg, world_size, local_procs, given, cuda)
    if passed is None and device_free is not None:
        device_free(resolved)
    return resolved


def _resolved_and_checked(
    cfg: RunConfig,
    world_size: int,
    local_procs: int | None,
    given: dict[str, str] | None,
    cuda: bool,
    count_gpus: bool = True,
) -> RunConfig:
    resolved = resolve(cfg, world_size, cuda)
    check(resolved, world_size, local_procs, count_gpus)
    if given is not None:
        check_effective(resolved, given)
    return resolved


def _on_either_device(
    cfg: RunConfig, world_size: int, local_procs: int | None, given: dict[str, str] | None
) -> RunConfig | None:
    """cfg resolved for the CPU, or else for cuda, whichever passes (GPUs not counted);
    the refusal both give, raised; None when they refuse differently (torch decides)."""
    refusals: list[ValueError] = []
    for cuda in (False, True):
        try:
            return _resolved_and_checked(cfg, world_size, local_procs, given, cuda, False)
        except ValueError as e:
            refusals.append(e)
    if str(refusals[0]) == str(refusals[1]):
        raise refusals[0]
    return None
