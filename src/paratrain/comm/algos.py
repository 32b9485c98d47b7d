"""Which algorithm serves a call: ours where one exists for the op, else the backend's.

`native` is the backend's own collective (the fast path); `ring` and `tree` are ours, built
on point-to-point messages (ring.py, tree.py) to be measured and understood. A call may
name its algorithm; otherwise the group's run-wide default applies where the op has it.
"""

from __future__ import annotations

from paratrain.comm.group import CommGroup

OUR_ALGOS = {  # per op, the algorithms of config.COMM_ALGOS it offers
    "all_reduce": ("native", "ring", "tree"),
    "reduce_scatter": ("native", "ring"),
    "all_gather": ("native", "ring"),
    "broadcast": ("native", "tree"),
    "reduce": ("native", "tree"),
}


def choose_algo(group: CommGroup, algo: str | None, op: str) -> str:
    """`algo` if given (ValueError if the op lacks it), else the group's default or native."""
    chosen = algo or group.options.algo
    valid = OUR_ALGOS.get(op, ("native",))
    if chosen not in valid:
        if algo is None:  # a run-wide default that this op lacks: use the backend's own
            return "native"
        raise ValueError(f"{op} has no {chosen!r} algorithm; valid: {', '.join(valid)}")
    return chosen


# The backend's own whatever the default (all_to_all: unless a call names "pairwise").
OTHER_OPS = ("gather", "scatter", "send/recv", "all_to_all")


def algorithms_line(default: str) -> str:
    """Which ops run which algorithm under a run-wide default: said at start, since an op
    without the default's algorithm falls back to the backend's."""
    ours = [op for op, algos in OUR_ALGOS.items() if default in algos]
    native = [op for op, algos in OUR_ALGOS.items() if default not in algos] + list(OTHER_OPS)
    if default == "native":
        return "collectives: every op native (the backend's own)"
    return f"collectives: {default} for {', '.join(ours)}; native for {', '.join(native)}"
