"""A timeline as a Chrome trace: the trace-event JSON read by chrome://tracing and Perfetto."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratrain.measure.spans import Span, span_name


def _metadata(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def chrome_trace(spans: Sequence[Span], num_stages: int, chunks: int = 1) -> dict[str, Any]:
    """The trace-event format read by chrome://tracing and Perfetto.

    One process per stage (`pid` = stage, named "stage s"), compute on thread 0 and, when
    present, communication on thread 1, so waiting shows as gaps on the compute row.
    Complete events ("ph": "X") with `ts` and `dur` in microseconds.
    """
    events: list[dict[str, Any]] = []
    for stage in range(num_stages):
        events.append(_metadata("process_name", stage, 0, name=f"stage {stage}"))
        events.append(_metadata("process_sort_index", stage, 0, sort_index=stage))
        events.append(_metadata("thread_name", stage, 0, name="compute"))
        events.append(_metadata("thread_name", stage, 1, name="comm"))
    for s in sorted(spans, key=lambda s: (s.stage, s.start)):
        events.append(
            {
                "name": span_name(s, chunks),
                "cat": s.category,
                "ph": "X",
                "ts": round(s.start * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "pid": s.stage,
                "tid": 0 if s.is_compute else 1,
                "args": {"kind": s.kind, "microbatch": s.microbatch, "chunk": s.chunk},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    spans: Sequence[Span], path: str | Path, num_stages: int, chunks: int = 1
) -> Path:
    """Write `chrome_trace(...)` as JSON to `path` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, num_stages, chunks)))
    return path
