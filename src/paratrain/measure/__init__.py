"""Instruments that measure what the runtime does, and the files that show it.

It imports `comm.compat` and the pipeline's data (schedules, simulations, step traces)
and nothing else from paratrain; no strategy imports it: the pipeline runtime is handed an
`ActivationMeter` (activations.py: saved-tensor hooks count what autograd keeps for
backward) by whoever builds it. This file imports none of its modules, so importing the
meter loads no drawing code. `AllocatorMeter` (allocator.py) measures what the
allocator holds over a region (torch.profiler's memory events on CPU, the CUDA caching
allocator's peak on CUDA), which the ZeRO and FSDP memory tests use; a pipeline's
simulated or recorded timeline, converted to `Span`s (spans.py; pipeline_spans.py
converts), is written as a Chrome trace (chrome_trace.py) or a
Gantt PNG (gantt.py), and a simulated one drawn as text (text_timeline.py); tcp_bytes.py
reads the bytes this process put on the wire from the kernel's TCP counters.
"""
