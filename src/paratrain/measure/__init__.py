"""Instruments that measure what the runtime does, and the files that show it.

A leaf: it imports nothing else from paratrain, so the runtime can use it; this file
imports none of its modules, so importing the meter loads no drawing code. The pipeline
runtime runs each forward under an `ActivationMeter` (activations.py: saved-tensor hooks
count what autograd keeps for backward); `AllocatorMeter` (allocator.py) measures what the
allocator holds over a region (torch.profiler's memory events on CPU, the CUDA caching
allocator's peak on CUDA), which the ZeRO and FSDP memory tests use; a pipeline's
simulated or recorded timeline, converted to `Span`s (spans.py; the conversion lives in
parallel/pipeline/span_convert.py), is written as a Chrome trace (chrome_trace.py) or a
Gantt PNG (gantt.py).
"""
