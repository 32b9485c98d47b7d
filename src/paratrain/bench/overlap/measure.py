"""How much communication the backward (and FSDP's forward) hides, measured by time.

One rank's side of the measurement, for one mechanism and one algorithm. Two groups on the
same process group differ only in `CommOptions.overlap`: with it off, every asynchronous
collective completes before it returns, so the step is compute plus communication. Steps
with overlap on and off alternate; per pair,

    hidden = (T_off - T_on) / C_off

where T is the wall time of the part of the step that holds the communication and C_off
the seconds the off step spent in its collectives (all of them exposed). 1 means all
communication ran behind compute; 0 means none did. The median over pairs is reported,
and beside it the same fraction from where the waiting happens: 1 - W_on / C_off, with
W_on the seconds the on step's training thread was blocked in waits. The first includes
everything overlap costs (the communication's own CPU time, taken from the compute it
runs beside); the second only the waiting, and is the steadier one on a loaded machine.

Waiting for a peer that is still computing is not communication: on a loaded machine one
rank's backward can take tens of milliseconds longer than the other's, and the faster
rank then waits that long in its last collective (with overlap) or in every one (without).
So every step starts at a barrier, and the waits are taken per pair from the rank that
waited least (the one whose peer was ready for it). Beside three busy processes on 2
cores, ZeRO-2's fraction from the waits (native) was 0.44-0.81 per rank without either;
with both (and wait.py's `hold_until` no longer yielding the CPU for a call already due)
0.82-0.88 for every mechanism and algorithm, as on a quiet machine (0.85-0.9). With
overlap off on both sides it stays within 0.09 of 0, and with the ring's call run before
the hook returns (blocking, clock from the issue) it measured -0.06.

The link is slowed by `CommOptions.link_latency_s` per message step, so that communication
is long enough to time and costs waiting, as on a real network, rather than CPU that the
two ranks' computation already uses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.data_parallel.replica import Replica
from paratrain.parallel.data_parallel.zero import ZeroDataParallel


@dataclass(frozen=True)
class LinearStack:
    """A stack of wide linear layers: each a bucket (DP, ZeRO-2) or a unit (FSDP) of its
    own, so communication can start after the first layer's gradients.

    comm_share: the link latency is set, per mechanism, so that communication without
    overlap takes this share of the compute it could hide behind (measured first, the
    fastest of a few steps): long enough to time, short enough that it can all be hidden
    but for the last layer's, on any machine and under any load.
    """

    # Narrow and deep in the batch: compute grows with batch x width^2, bytes with width^2
    # only, so little of the communication is CPU work that competes with the compute.
    width: int = 128
    layers: int = 8
    batch: int = 16384
    comm_share: float = 0.5
    pairs: int = 9
    control: bool = False  # both sides without overlap: then nothing may appear hidden

    @property
    def layer_mb(self) -> float:
        return (self.width * self.width + self.width) * 4 / 2**20


def build_stack(w: LinearStack) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(w.layers):
        layers += [nn.Linear(w.width, w.width), nn.Tanh()]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class Mechanism:
    """How one mechanism wraps the workload's model, and where its communication is."""

    wrap: Callable[[nn.Module, LinearStack, comm.CommGroup], Replica]
    # Message steps per layer, in units of k - 1 at k ranks: a bucket's all-reduce 2,
    # ZeRO-2's reduce-scatter 1, FSDP's forward and backward gathers and reduce-scatter 3.
    steps_per_layer: int
    in_forward: bool  # FSDP gathers in forward too: the timed window starts there


def _fsdp_units(w: LinearStack) -> list[list[str]]:
    return [[str(i), str(i + 1)] for i in range(0, 2 * w.layers, 2)]  # Linear and its Tanh


MECHANISMS: dict[str, Mechanism] = {
    "dp-buckets": Mechanism(
        lambda m, w, g: DataParallel(m, g, bucket_mb=w.layer_mb), 2, in_forward=False
    ),
    "zero2": Mechanism(
        lambda m, w, g: ZeroDataParallel(m, g, stage=2, bucket_mb=w.layer_mb), 1, False
    ),
    "fsdp-prefetch": Mechanism(
        lambda m, w, g: FullyShardedDataParallel(m, g, _fsdp_units(w), prefetch=1), 3, True
    ),
}


def _step(
    model: Replica,
    mechanism: Mechanism,
    x: torch.Tensor,
    ledger: comm.Ledger,
    group: str,
    align: comm.CommGroup,
) -> tuple[float, float]:
    """(wall seconds, seconds spent in this group's collectives) of the part of a training
    step that holds its communication: backward and the final wait, and the forward where
    the mechanism communicates there. Timing less keeps the compute's noise out of the
    difference. Every rank starts it together (`align`), so that no wait carries over
    from how late a peer finished the step before."""
    model.zero_grad()
    comm.barrier(align)
    ledger.reset()
    start = time.perf_counter()
    loss = model(x).square().mean()
    if not mechanism.in_forward:
        start = time.perf_counter()
    loss.backward()
    model.finish_gradient_sync()
    wall = time.perf_counter() - start
    in_comm = sum(t["wait_s"] for t in ledger.report().get(group, {}).values())
    return wall, in_comm


def _groups(
    ledger: comm.Ledger, algo: str, latency_s: float, control: bool = False
) -> dict[bool, comm.CommGroup]:
    """Two groups on the world's process group that differ only in overlap."""
    return {
        on: comm.CommGroup.world(
            ledger,
            name=f"overlap-{'on' if on else 'off'}",
            options=comm.CommOptions(
                algo=algo, overlap=on and not control, link_latency_s=latency_s
            ),
        )
        for on in (True, False)
    }


def link_latency(mechanism: Mechanism, w: LinearStack, world: int, x: torch.Tensor) -> float:
    """Seconds per message step that make communication `w.comm_share` of the compute
    window: the fastest of three steps without communication cost, agreed by all ranks."""
    ledger = comm.Ledger()
    group = _groups(ledger, "native", 0.0)[False]
    model = mechanism.wrap(build_stack(w), w, group)
    align = comm.CommGroup.world(ledger, name="overlap-align")
    compute = min(_step(model, mechanism, x, ledger, group.name, align)[0] for _ in range(3))
    steps = mechanism.steps_per_layer * (world - 1) * w.layers
    latency = torch.tensor([w.comm_share * compute / steps], dtype=torch.float64)
    return float(comm.all_reduce(latency, group, op="min"))


def measure(rank: int, world: int, mechanism: str, algo: str, w: LinearStack) -> dict:
    """Alternate `w.pairs` steps with overlap on and off (after one warm-up each)."""
    x = torch.randn(w.batch, w.width, generator=torch.Generator().manual_seed(rank))
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism {mechanism!r}; valid: {', '.join(MECHANISMS)}")
    how = MECHANISMS[mechanism]
    latency = link_latency(how, w, world, x)
    ledger = comm.Ledger()
    groups = _groups(ledger, algo, latency, w.control)
    align = comm.CommGroup.world(ledger, name="overlap-align")
    models = {on: how.wrap(build_stack(w), w, g) for on, g in groups.items()}
    runs: dict[bool, list[tuple]] = {True: [], False: []}
    for i in range(w.pairs + 1):
        for on in (True, False) if i % 2 else (False, True):  # neither side always first
            runs[on].append(_step(models[on], how, x, ledger, groups[on].name, align))
    on_runs, off_runs = runs[True][1:], runs[False][1:]
    hidden = [(off[0] - on[0]) / off[1] for on, off in zip(on_runs, off_runs, strict=True)]
    # Per pair, each side's wait on the rank that waited least (module docstring).
    waits = torch.tensor([[r[1] for r in on_runs], [r[1] for r in off_runs]], dtype=torch.float64)
    least_on, least_off = torch.stack(comm.all_gather(waits, align)).amin(dim=0)
    waited = (1 - least_on / least_off).tolist()
    return {
        "mechanism": mechanism,
        "algo": algo,
        "link_latency_s": latency,
        "hidden": statistics.median(hidden),
        "hidden_all": hidden,
        "hidden_by_wait": statistics.median(waited),
        "hidden_by_fastest": (min(r[0] for r in off_runs) - min(r[0] for r in on_runs))
        / statistics.median(r[1] for r in off_runs),
        "step_on_s": statistics.median(r[0] for r in on_runs),
        "step_off_s": statistics.median(r[0] for r in off_runs),
        "comm_off_s": statistics.median(r[1] for r in off_runs),
        "exposed_on_s": statistics.median(r[1] for r in on_runs),
    }
