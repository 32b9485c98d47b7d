"""Pipeline parallelism: schedules as data, a checker, a stage splitter and one runtime.

    schedule = build_schedule("1f1b", num_stages, num_microbatches, chunks)   # pure data
    simulation = check_schedule(schedule)            # proves it; bubble, peak in-flight
    chunks = split_into_stages(model, stage, num_stages, chunks, plan=plan)  # full, then slice
    runtime = PipelineRuntime(chunks, schedule, mesh.group("pp"), hidden_size)
    loss = runtime.run_step(micro_batches)           # gradients accumulated over K
    val = runtime.run_forward(val_batches)           # forward-only schedule

The same schedule is drawn in measure/: as text (text_timeline.py: `render_grid`); a
simulation or the runtime's recorded `StepTrace`s (step_trace.py) become spans for a
Chrome trace and a Gantt chart (pipeline_spans.py); `paratrain schedule` is commands/schedule.py.
This package imports nothing from measure/, train/ or a command: a meter of the saved
activations is handed to the runtime (`meter=`).
See docs/pipeline.md for the schedules, their bubbles and memory, with sources.
"""

import importlib
from typing import TYPE_CHECKING, Any

from paratrain.parallel.pipeline.check import Simulation, check_schedule
from paratrain.parallel.pipeline.schedules import (
    Action,
    Costs,
    Schedule,
    ScheduleError,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from paratrain.parallel.pipeline.step_trace import Event, StepTrace

if TYPE_CHECKING:
    from paratrain.parallel.pipeline.runtime import PipelineRuntime
    from paratrain.parallel.pipeline.stage import PipelinePlan, split_into_stages, stage_layout
    from paratrain.parallel.pipeline.tied import TiedWeights, find_tied_weights

# The schedules and their checker are pure; these need torch, so they load on first use:
# checking a schedule (a refusal, `paratrain schedule`) must not wait for torch.
_NEEDS_TORCH = {
    "PipelineRuntime": "runtime",
    "PipelinePlan": "stage",
    "split_into_stages": "stage",
    "stage_layout": "stage",
    "TiedWeights": "tied",
    "find_tied_weights": "tied",
}


def __getattr__(name: str) -> Any:
    if name in _NEEDS_TORCH:
        return getattr(importlib.import_module(f"{__name__}.{_NEEDS_TORCH[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Action",
    "Costs",
    "Event",
    "PipelinePlan",
    "PipelineRuntime",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "StepTrace",
    "TiedWeights",
    "build_schedule",
    "check_schedule",
    "find_tied_weights",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "split_into_stages",
    "stage_layout",
    "zb_h1",
]
