"""What the participants of a round do together: the gradient's mean over their tokens,
and a group that is behind copying the whole training state from a live peer."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from paratrain import comm
from paratrain.checkpoint import scaler_state
from paratrain.comm.group import CommGroup
from paratrain.train.engine import Engine


def mean_across(engine: Engine, across: CommGroup, loss: float, tokens: int) -> tuple[float, int]:
    """Each group's gradient is the sum over its own tokens; summed over the participants
    and divided by all their tokens it is the mean over them. Returns the mean loss and
    the tokens of the participants."""
    # On the host: `across` is gloo, made from the coordinator's store (participant.py)
    totals = torch.tensor([loss * tokens, float(tokens)], dtype=torch.float64, device="cpu")
    comm.all_reduce(totals, across)
    total_tokens = float(totals[1])
    # The gradients hold sums over the group's tokens: summed over the participants they
    # owe 1 / their tokens, paid with the clip's factor (the rounding of a run without it)
    engine.owed *= tokens / max(total_tokens, 1.0)
    for r in engine.replicas:
        r.all_reduce_grads_([n for n, _ in r.module.named_parameters()], across)
    return float(totals[0]) / max(total_tokens, 1.0), int(total_tokens)


def state_tensors(engine: Engine, optimizer: Any) -> list[torch.Tensor]:
    """Every tensor of this rank's training state, as views of live storage: parameters,
    optimizer moments and step counters, persistent buffers, and the random generator."""
    tensors: list[torch.Tensor] = []
    for r, opt in zip(engine.replicas, optimizer.optimizers, strict=True):
        pieces, counters = r.checkpoint_pieces(opt)
        tensors += [t for piece in pieces for t in piece.tensors.values()]
        tensors += list(counters)
    for module in engine.modules:
        tensors += [b for _, b in module.named_buffers() if b.is_floating_point()]
    return tensors + global_tensors(optimizer)


def global_tensors(optimizer: Any) -> list[torch.Tensor]:
    """DiLoCo's global parameters and outer momentum (none in another mode)."""
    outer = getattr(optimizer, "outer", None)
    return [] if outer is None else [*outer.global_, *outer.velocity]


def scaler_tensor(engine: Engine) -> torch.Tensor:
    """fp16's loss scaler state (Python numbers; the same on every replica, as the
    checkpoint saves it) as a float64 host tensor; empty without fp16."""
    return torch.tensor(list((scaler_state(engine) or {}).values()), dtype=torch.float64)


def load_scaler_tensor(engine: Engine, values: torch.Tensor) -> None:
    keys = scaler_state(engine) or {}
    for r in engine.replicas:
        if r.scaler is not None:
            r.scaler.load_state_dict(dict(zip(keys, values.tolist(), strict=True)))


def state_digest(engine: Engine, optimizer: Any, group: CommGroup) -> str:
    """SHA-256 of the whole training state of a replica group (every rank's
    `state_tensors` and loss scalers, bit for bit, in rank order): equal digests, equal
    states."""
    return digest([*state_tensors(engine, optimizer), scaler_tensor(engine)], group)


def digest(tensors: list[torch.Tensor], group: CommGroup) -> str:
    """SHA-256 of every rank's `tensors` of `group`, bit for bit, in rank order (group
    rank 0 gets it; the others "")."""
    mine = hashlib.sha256()
    for t in tensors:
        mine.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest = torch.frombuffer(bytearray(mine.digest()), dtype=torch.uint8)
    everyone = comm.gather(digest, group)  # group rank 0 gets them; the others None
    return (
        hashlib.sha256(b"".join(d.numpy().tobytes() for d in everyone)).hexdigest()
        if everyone
        else ""
    )


def heal(engine: Engine, optimizer: Any, across: CommGroup, source: int, receive: bool) -> None:
    """Copy `source`'s (a rank of `across`) training state to the participants that are
    behind (`receive` on their ranks), bit for bit: one broadcast per dtype of the whole
    state, then the random generator and fp16's loss scalers; the others receive into
    scratch and keep their own, so that a copy cut short by a failure changes nothing but
    the group behind, which is still behind."""
    tensors = state_tensors(engine, optimizer)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    received = []
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        received.append((group, comm.broadcast(flat, across, src=source)))
    rng = comm.broadcast(torch.get_rng_state(), across, src=source)
    scalers = scaler_tensor(engine)  # on the host: `across` is gloo; under fp16 only
    if scalers.numel():  # (the same on every participant: one configuration)
        scalers = comm.broadcast(scalers, across, src=source)
    if not receive:
        return
    for group, flat in received:
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    torch.set_rng_state(rng)
    load_scaler_tensor(engine, scalers)
    for r in engine.replicas:
        r.after_load()
