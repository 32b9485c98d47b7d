"""What one rank measures while `paratrain.train.loop.train` runs, for `plan --validate`.

Each rank trains our small GPT through the real loop and records, without changing it:
- model-state bytes, itemised (params, grads, optimizer, master): the runtime's own record
  at the last step's end, `TrainResult.extra["model_state_bytes"]` (train/engine.py: tensor
  sizes for DataParallel; for ZeRO and FSDP the wrappers' flat buffers and shards, their
  padding counted under params; AdamW's per-tensor `step` counters are left out);
- bytes sent per step by group and op, from the comm ledger, from after set-up (the
  replicas' initial parameter broadcast is not a step's traffic) to each step's end;
- in-flight activations: a forward hook opens an `ActivationMeter` around every forward of
  one of this rank's chunks (saved-tensor bytes, parameters excluded) and a hook on its
  output closes the account when that graph's backward begins: the peak number of graphs
  held and the peak of their bytes;
- bytes on the wire per step by process group (on_wire.py: the kernel's TCP counters,
  read at the ledger's points, each socket attributed to its group by a probe before
  training);
- for a pipeline, the runtime's own trace of each step (compute, receive and send times,
  and its start and end on the machine's one clock, so stages line up),
  and the step replayed with the meter's bytes per forward to hold each graph until its
  last backward pass, as the runtime does: with ZB-H1 the deferred weight gradient, after
  the hook above has fired at the input-gradient pass.

The loop builds its engine itself and hands it to `on_start` before the first step:
that is where the graph meter attaches, and the engine (its modules, its pipeline
runtime) is kept for the per-step measurements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.bench.planner.cases import SLOW_UNIT_S, TIMEOUT_S, Case, small_config
from paratrain.bench.planner.on_wire import per_group, probe_sockets
from paratrain.bench.planner.slowdown import Slowdown
from paratrain.comm.watchdog import default_store_or_none
from paratrain.config import RunConfig
from paratrain.measure import tcp_bytes as wire
from paratrain.measure.activations import ActivationMeter
from paratrain.mesh import Mesh
from paratrain.parallel.pipeline.schedules import (
    BI,
    BW,
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    B,
    F,
)
from paratrain.spawn import run_ranks


def random_tokens(vocab: int, n: int = 20_000) -> Any:
    from paratrain.data.tokens import TokenData

    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    return TokenData(ids.to(torch.uint8), ids[:0].to(torch.uint8), 256, "random", "random")


def ledger_bytes(mesh: Mesh) -> dict[tuple[str, str], int]:
    return {key: t.bytes_sent for key, t in mesh.ledger.totals().items()}


def ledger_calls(mesh: Mesh) -> dict[tuple[str, str], int]:
    return {key: t.calls for key, t in mesh.ledger.totals().items()}


class LiveParamsMeter(ActivationMeter):
    """The activation meter, with parameters recognised by their storage at pack time.

    Under ZeRO-3 a module's parameters are views of its unit's gathered buffer, which has
    storage only while gathered (parallel/fsdp_units.FlatUnit): the meter's set of
    parameter storages, taken before the gather, misses them, and the weights the Linears
    save would count as activations (6 (b, T, C) tensors a block here). They are model
    state, freed after the forward and gathered again for backward.
    """

    def __init__(self, model: nn.Module, regions: dict[str, nn.Module]) -> None:
        super().__init__(model, regions)
        self.model = model

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        live = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        if t.untyped_storage().data_ptr() in live:
            return t
        return super()._pack(t)


class GraphMeter:
    """Live forward graphs of this rank's chunks and their saved-tensor bytes."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.live = self.live_bytes = 0
        self.peak = self.peak_bytes = 0
        self.block_bytes: list[int] = []  # per block per forward
        self.forward_bytes: list[int] = []  # per training forward, in order
        self._open: list[ActivationMeter] = []
        hook_tables: set[int] = set()
        for m in modules:
            # Pipeline chunks are shallow copies of one model and share its hook tables:
            # register once per table, tell the chunks apart by the module called.
            if id(m._forward_pre_hooks) in hook_tables:
                continue
            hook_tables.add(id(m._forward_pre_hooks))
            m.register_forward_pre_hook(self._before)
            m.register_forward_hook(self._after)

    def _before(self, module: nn.Module, _args: Any) -> None:
        blocks = getattr(module, "blocks", {})
        regions = {f"block {name}": b for name, b in blocks.items()}
        meter = LiveParamsMeter(module, regions)
        meter.__enter__()
        self._open.append(meter)

    def _after(self, _module: nn.Module, _args: Any, out: Any) -> None:
        meter = self._open.pop()
        meter.__exit__(None, None, None)
        if not (torch.is_tensor(out) and out.requires_grad):
            return  # evaluation: nothing is kept for a backward
        nbytes = meter.total
        self.forward_bytes.append(nbytes)
        self.block_bytes += [v for k, v in meter.by_region.items() if k.startswith("block")]
        self.live += 1
        self.live_bytes += nbytes
        self.peak = max(self.peak, self.live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

        done: list[bool] = []

        def released(grad: torch.Tensor) -> None:  # this graph's backward starts
            if done:  # a split backward (ZB-H1's B then W) passes through twice
                return
            done.append(True)
            self.live -= 1
            self.live_bytes -= nbytes

        out.register_hook(released)

    def take(self) -> dict[str, Any]:
        """This step's peaks; the counters start again for the next step."""
        out: dict[str, Any] = {"peak_graphs": self.peak, "peak_bytes": self.peak_bytes}
        out["block_bytes"] = max(self.block_bytes, default=0)
        out["forward_bytes"] = self.forward_bytes
        self.peak, self.peak_bytes, self.block_bytes = self.live, self.live_bytes, []
        self.forward_bytes = []
        return out


def held_until_last_pass(actions: tuple[Any, ...], forward_bytes: list[int]) -> tuple[int, int]:
    """Peak graphs and bytes a stage holds when each graph lives from its F to its last
    backward pass (B, or the deferred BW of a split backward): the step replayed with the
    bytes the meter saw for each forward, in order. The runtime keeps them exactly so long
    (its `saved`); its own byte count is blind here, because the meter's saved-tensor
    hooks sit inside the runtime's."""
    sizes = iter(forward_bytes)
    live: dict[tuple[int, int], int] = {}
    peak = peak_bytes = 0
    for a in actions:
        if a.kind == F:
            live[(a.microbatch, a.chunk)] = next(sizes, 0)
            peak, peak_bytes = max(peak, len(live)), max(peak_bytes, sum(live.values()))
        elif a.kind in (B, BW):
            live.pop((a.microbatch, a.chunk))
    return peak, peak_bytes


def trace_summary(trace: Any) -> dict[str, float]:
    """A pipeline step from the runtime's own timestamps: where the stage's time went."""

    def total(kinds: tuple[str, ...]) -> float:
        return sum(e.end - e.start for e in trace.events if e.action.kind in kinds)

    def mean(kind: str) -> float:
        times = [e.end - e.start for e in trace.events if e.action.kind == kind]
        return sum(times) / len(times) if times else 0.0

    return {
        "start": trace.start,  # time.perf_counter(): one clock for the machine's processes
        "end": trace.end,
        "span_s": trace.end - trace.start,
        "busy_s": total(COMPUTE),
        "recv_s": total((RECV_F, RECV_B)),
        "receives": sum(e.action.kind in (RECV_F, RECV_B) for e in trace.events),
        "send_s": total((SEND_F, SEND_B)),
        "forward_s": mean(F),
        "backward_s": mean(B),
        "input_s": mean(BI),  # ZB-H1's split backward
        "weight_s": mean(BW),
        "bubble": trace.bubble_fraction(),
        "trace_peak": trace.peak_in_flight,
    }


def measure_rank(rank: int, world: int, cfg: RunConfig, unit_s: float = 0.0) -> dict[str, Any]:
    """Train under cfg's layout; what this rank held, sent and kept (see the docstring).
    `unit_s` > 0 slows every pass of a pipeline's chunks by that sleep (slowdown.py)."""
    from paratrain.train.loop import train

    p = cfg.parallel
    mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep)
    exclude = wire.store_ports(default_store_or_none())  # a TCPStore's socket is not a peer's
    owner = probe_sockets(mesh, exclude)
    kept: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []

    def on_start(engine: Any) -> None:
        kept["engine"] = engine
        kept["graphs"] = GraphMeter(engine.modules)
        if unit_s > 0:
            Slowdown(engine.modules, unit_s, split_backward=p.schedule == "zb-h1")
        kept["before"] = ledger_bytes(mesh)  # set-up done, the first step not begun
        kept["calls"] = ledger_calls(mesh)
        kept["wire"] = wire.settled_counters(exclude)

    def on_step(_: Any) -> None:
        now, calls, sockets = ledger_bytes(mesh), ledger_calls(mesh), wire.settled_counters(exclude)
        sent = {k: v - kept["before"].get(k, 0) for k, v in now.items()}
        moved = wire.deltas(kept["wire"], sockets)
        step: dict[str, Any] = {
            "sent": {k: v for k, v in sent.items() if v},
            "calls": {k: v - kept["calls"].get(k, 0) for k, v in calls.items()},
            "wire": per_group(moved, owner),
        }
        kept["before"], kept["calls"], kept["wire"] = now, calls, sockets
        step.update(kept["graphs"].take())
        runtime = kept["engine"].runtime  # None without a pipeline
        if runtime is not None:
            step["trace"] = trace_summary(runtime.last_trace)
            actions = runtime.schedule.stages[runtime.stage]
            held = held_until_last_pass(actions, step["forward_bytes"])
            step["held_graphs"], step["held_bytes"] = held
        steps.append(step)

    try:
        data = random_tokens(cfg.model.vocab_size)
        result = train(cfg, mesh, data, on_step=on_step, on_start=on_start)
    finally:
        mesh.close()
    return {
        "coords": {axis: mesh.coord(axis) for axis in ("pp", "dp", "tp", "cp")},
        **result.extra["model_state_bytes"],  # params, grads, optimizer, master
        "steps": steps,
    }


def run_case(case: Case, steps: int = 3) -> list[dict[str, Any]]:
    """Train the case in layout.world gloo processes; each rank's measurements, by rank.

    A pipeline's compute is slowed by a sleep per pass (record.Slowdown, SLOW_UNIT_S a
    unit) so that the bubble measured from the runtime's timestamps is the schedule's,
    not the noise of a tiny model's milliseconds on shared cores."""
    cfg = small_config(case, steps)
    unit = SLOW_UNIT_S if case.layout.pp > 1 else 0.0
    return run_ranks(measure_rank, case.layout.world, cfg, unit, timeout=TIMEOUT_S)
