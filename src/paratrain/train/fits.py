"""A layout whose predicted memory per rank exceeds the device is refused before any
worker starts, with the figures: on CUDA each rank's prediction against its GPU's memory,
on the CPU the ranks' sum against the memory this host has available (they share it).

Without this, `--seq-len 100000` passed --dry-run predicting terabytes of activations per
rank and then sat in step 1, swapping. The prediction is the planner's (train/prediction.py:
model state exact, activations Korthikanti's estimate), so only a layout predicted beyond
the memory is refused, never one that merely comes close.
"""

from __future__ import annotations

from paratrain.config import RunConfig, device_type
from paratrain.machine import cuda_memory_bytes, host_memory_bytes

GB = 1e9
ADVICE = (
    "use a shorter --seq-len, a smaller --micro-batch, --recompute full, or split the model "
    "over more ranks (--tp, --pp, --cp, --zero 3)"
)


def _size(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / GB:.2f} GB"


def fits_refusal(
    per_rank: list[tuple[float, float]], capacity: float, shared: bool, where: str, first: int = 0
) -> str | None:
    """Why (model state, activations) per rank do not fit in `capacity` bytes, or None.
    shared: the ranks share the capacity (one host's memory) rather than each having it.
    first: the global rank of per_rank[0]."""
    worst = max(range(len(per_rank)), key=lambda r: sum(per_rank[r]))
    state, acts = per_rank[worst]
    need = sum(map(sum, per_rank)) if shared else state + acts
    if need <= capacity:
        return None
    each = f"{_size(state + acts)} (model state {_size(state)} + activations {_size(acts)}, "
    each += "predicted)"
    if shared and len(per_rank) > 1:
        said = f"{len(per_rank)} ranks need {_size(need)} together, rank {first + worst} {each}"
    else:
        said = f"rank {first + worst} needs {each}"
    return f"{said}, beyond {where} of {_size(capacity)}; {ADVICE}"


def check_fits(cfg: RunConfig, here: range | None = None) -> None:
    """Refuse a layout predicted beyond this machine's memory (ValueError, one line).
    here: the global ranks on this machine (a node of torchrun's); default every rank."""
    if cfg.parallel.dp_mode == "async":  # not predicted (train/prediction.py)
        return
    from paratrain.train.prediction import predict

    pred = predict(cfg)
    per_rank = [
        (float(s["total"]), float(a or 0.0))
        for s, a in zip(pred.model_state, pred.activation_bytes, strict=True)
    ]
    if here is not None:
        per_rank = [per_rank[r] for r in here]
    if device_type(cfg) == "cuda":
        capacity, shared, where = cuda_memory_bytes(), False, "its GPU's memory"
    else:
        capacity, shared, where = host_memory_bytes(), True, "this host's available memory"
    if capacity is None:
        return
    why = fits_refusal(per_rank, capacity, shared, where, here.start if here else 0)
    if why is not None:
        raise ValueError(why)
