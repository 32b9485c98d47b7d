"""Bytes on the wire per step and process group, for `plan --validate`'s traffic rows.

The ledger records native collectives from the ring formula, so comparing it with the
planner compares a formula with a formula. Here each rank reads the kernel's TCP counters
(measure/tcp_bytes.py) at the ledger's own points (after set-up, after each step) and the
predicted bytes are compared with what really crossed the sockets.

Which socket carries which group: gloo opens its own TCP connections for every process
group. Before training, each distinct group (world first, then dp, tp, pp, control) is
probed in turn with a small all-reduce, between settled readings and followed by a
world barrier, so no rank can start the next probe while another still reads: the
sockets whose counters moved belong to that group (the first group to move a socket
keeps it, so the barriers' own traffic on the world sockets cannot be mistaken). Groups
that share a process group (an axis as large as the world) share its sockets and a row.

The comparison (`wire_rows`): the planner's formula F, gloo's algorithm G (the same
terms, a reduce-scatter counted as the all-reduce gloo does: bench/comm/wire.py), and the
measurement W; a row holds when G <= W <= G + 1 KB x (k-1) x calls, the gloo preambles
(48 bytes a message; 576 for a 2-rank all-reduce of any size).
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain import comm
from paratrain.bench.planner.cases import Case, Row
from paratrain.bench.planner.sent import rank_terms
from paratrain.measure import tcp_bytes as wire
from paratrain.mesh import Mesh
from paratrain.plan.layout import Workload
from paratrain.plan.model import ModelSpec

# probed in this order, world first; a derived group as large as the one it refines is
# that group (mesh.py) and shares its row
NAMES = ("world", "dp", "dp_cp", "cp", "tp", "pp", "ep", "expert_dp", "control")
PREAMBLE_BOUND = 1024  # bytes per call per peer step: gloo's preambles (576 observed at k=2)
GLOO_FACTOR = {"reduce_scatter": 2}  # gloo all-reduces, keeps a chunk: 2 (k-1)/k S


def probe_sockets(mesh: Mesh, exclude_ports: tuple[int, ...] = ()) -> dict[int, str]:
    """Socket inode -> the label of the process group it carries (module docstring)."""
    distinct: dict[int, tuple[comm.CommGroup, list[str]]] = {}
    for name in NAMES:
        g = mesh.control if name == "control" else mesh.group(name)
        if g.pg is not None and g.size > 1:
            distinct.setdefault(id(g.pg), (g, []))[1].append(name)
    owner: dict[int, str] = {}
    for g, names in distinct.values():
        before = wire.settled_counters(exclude_ports)
        comm.all_reduce(torch.ones(256), g)
        moved = wire.deltas(before, wire.settled_counters(exclude_ports))
        for inode in moved:
            owner.setdefault(inode, "+".join(names))
        comm.barrier(mesh.group("world"))
    return owner


def per_group(moved: dict[int, wire.WireDelta], owner: dict[int, str]) -> dict[str, list[int]]:
    """label -> [payload bytes acknowledged, estimated TCP/IP header bytes]."""
    out: dict[str, list[int]] = {}
    for inode, d in moved.items():
        entry = out.setdefault(owner.get(inode, "unattributed"), [0, 0])
        entry[0] += d.acked
        entry[1] += d.header_bytes
    return out


def wire_rows(case: Case, m: dict[str, Any], model: ModelSpec, w: Workload) -> list[Row]:
    """Per group that carried bytes: formula against the wire, bounded by gloo's model."""
    terms = rank_terms(case, m, model, w)
    lay = case.layout
    sizes = {"dp": lay.dp, "dp_cp": lay.data_ranks, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp}
    sizes.update(ep=lay.ep, expert_dp=lay.data_ranks // lay.ep)
    rows = []
    for label in sorted({lab for s in m["steps"] for lab in s["wire"]}):
        names = label.split("+")
        mine = [t for t in terms if t.axis in names]
        formula = sum(t.bytes for t in mine)
        gloo = sum(GLOO_FACTOR.get(t.op, 1) * t.bytes for t in mine)
        k = max([sizes.get(n, 2) for n in names if n in sizes] or [2])
        steps = [s["wire"].get(label, [0, 0]) for s in m["steps"]]
        calls = [sum(v for (g, _), v in s["calls"].items() if g in names) for s in m["steps"]]
        slack = max(calls) * PREAMBLE_BOUND * (k - 1)
        worst = max((wb for wb, _ in steps), key=lambda wb: abs(wb - gloo - slack / 2))
        note = wire_note(formula, gloo, worst, max(calls), slack, steps[-1][1])
        routed = any(t.routed for t in mine)  # the router's tokens: shown, not bounded
        rows.append(
            Row(
                case.name,
                f"wire: {label} bytes/step ({len(steps)} steps)",
                formula,
                worst,
                exact=False,
                bounds=None if routed else (gloo, gloo + slack),
                note=("routed tokens predicted for a balanced router; " if routed else "") + note,
            )
        )
    return rows


def wire_note(formula: int, gloo: int, measured: int, calls: int, slack: int, head: int) -> str:
    parts = [f"{measured / formula:.4f} x the formula" if formula else "nothing predicted"]
    if gloo != formula:
        parts.append(f"gloo's reduce-scatter is an all-reduce: + {gloo - formula:,}")
    parts.append(f"gloo preambles {measured - gloo:,} in {calls} calls (bound {slack:,})")
    parts.append(f"TCP/IP headers ~{head:,} more, not counted")
    return "; ".join(parts)
