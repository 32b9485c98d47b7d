"""Rules on the pipeline: flags that need one, the pieces the model can be cut into, and
the schedule itself (built now, so its errors name the valid K and chunks)."""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.validate.batch_messages import check_schedule_batch


def pipeline_rules(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if p.pp == 1:
        if p.chunks != 1:
            raise ValueError(f"--chunks {p.chunks} needs a pipeline (--pp 2 or more)")
        if cfg.train.trace:
            raise ValueError("--trace draws the pipeline schedule: use --pp 2 or more, or drop it")
        return
    if p.pp * p.chunks > m.n_layer:
        raise ValueError(
            f"--pp {p.pp} x --chunks {p.chunks} = {p.pp * p.chunks} pipeline pieces but the "
            f"model has {m.n_layer} layers; use at most {m.n_layer} pieces"
        )
    if p.dp_mode == "async":
        raise ValueError("--dp-mode async does not combine with a pipeline; use --pp 1")
    check_schedule_batch(cfg)  # refused in flags, with a batch that would work
