"""The peer of `paratrain bench tp`: PyTorch's DTensor tensor parallel on the same GPT.

`parallelize_gpt_dtensor` applies `torch.distributed.tensor.parallel.parallelize_module`
to a full GPT (built from the same seed as ours) with the layout of our `GPT_TP_PLAN`,
style for style:

| our style | DTensor style |
|---|---|
| `vocab_embedding` | `RowwiseParallel` on the embedding (vocabulary rows split) |
| `attention` (f once for q, k, v) | `PrepareModuleInput` on `attn`: one conversion of its input |
| `colwise` (q, k, v, fc) | `ColwiseParallel()`, local output |
| `rowwise` (proj) | `RowwiseParallel()` |
| `vocab_head` + `vocab_loss` | `ColwiseParallel(use_local_output=False)` + `loss_parallel()` |
| `replicated`, sequence parallel | `SequenceParallel()` on the LayerNorms; the position |
|  | embedding's output redistributed to this rank's positions |

`PrepareModuleInput` on `attn` and `mlp` is what torchtitan does too: q, k and v then
take the same DTensor input, and their input gradients (partial sums) are added before
one all-reduce (or one reduce-scatter under sequence parallelism), as with our `f`.
`CommCounter` counts the peer's collectives with `CommDebugMode` and converts them to
bytes with the same ring formulas our ledger uses (`comm/traffic.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.comm.traffic import native_traffic


def dtensor_plan(n_layer: int, sequence_parallel: bool) -> dict[str, Any]:
    """The DTensor plan equivalent to GPT_TP_PLAN, module name -> ParallelStyle."""
    # Under sequence parallelism the residual stream is (B, T/tp, C) on each rank: the
    # embedding reduce-scatters along T, the row-parallel outputs too, and the split
    # regions' inputs are all-gathered back to the whole sequence.
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, use_local_output=False),
    }
    if sequence_parallel:
        # Positions are looked up whole and this rank's T/tp rows kept (no traffic
        # forward; the gradient is all-gathered in backward, so the table's gradient is
        # whole without a separate sum).
        plan["pos_emb"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)
        )
        plan["norm"] = SequenceParallel()
    for i in range(n_layer):
        block = f"blocks.{i}"
        for region in ("attn", "mlp"):
            plan[f"{block}.{region}"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
        for linear in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{block}.{linear}"] = ColwiseParallel()
        for linear in ("attn.proj", "mlp.proj"):
            plan[f"{block}.{linear}"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"{block}.ln1"] = SequenceParallel()
            plan[f"{block}.ln2"] = SequenceParallel()
    return plan


def describe_plan(plan: dict[str, Any]) -> str:
    """One line per distinct (module pattern, style), blocks collapsed to `blocks.*`."""
    seen: dict[str, str] = {}
    for name, style in plan.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            parts[1] = "*"
        seen.setdefault(".".join(parts), repr(style))
    return "\n".join(f"  {name}: {style}" for name, style in seen.items())


def parallelize_gpt_dtensor(
    model: nn.Module, world: int, sequence_parallel: bool
) -> tuple[nn.Module, DeviceMesh, dict[str, Any]]:
    """Make a full GPT tensor parallel with DTensor over all `world` ranks, in place."""
    mesh = DeviceMesh("cpu", list(range(world)))
    plan = dtensor_plan(len(model.blocks), sequence_parallel)
    parallelize_module(model, mesh, plan)
    return model, mesh, plan


def build_peer_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """Our AdamW (same groups, foreach=True), with DTensor and plain parameters kept in
    separate groups: a foreach kernel cannot take both kinds in one list."""
    groups = []
    for decay in (True, False):
        params = [p for p in model.parameters() if p.requires_grad and (p.dim() >= 2) == decay]
        for is_dtensor in (True, False):
            part = [p for p in params if isinstance(p, DTensor) == is_dtensor]
            if part:
                groups.append({"params": part, "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def peer_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One training step; loss_parallel covers forward and backward, as documented."""
    opt.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
    opt.step()
    return loss.to_local().item() if isinstance(loss, DTensor) else loss.item()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensor shards gathered). Collective."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


# ---- bytes from CommDebugMode's collectives --------------------------------------------

# op name (as CommDebugMode's dispatch sees it) -> (our op name, which argument is the
# tensor, whether its size is the full S of traffic.py or one rank's chunk of it)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
}


class CommCounter(CommDebugMode):
    """CommDebugMode's collective counts, plus each collective's size to count bytes.

    `get_comm_counts()` is CommDebugMode's (calls per op); `bytes_sent()` puts each call's
    size through the same ring formulas as our ledger (`native_traffic`). DTensor issues
    functional collectives (`_c10d_functional`), the ops sized here; any other
    collective is listed in `unsized`.

    CommDebugMode's per-module tracker is left out: in torch 2.13 it registers a forward
    hook per call and pops its parent stack twice for a module called twice in one
    forward (GPT's `Block.drop`), which raises IndexError (and leaves hooks behind). The
    dispatch logic below is CommDebugMode's, without that bookkeeping.
    """

    def __init__(self, group_size: int, rank: int) -> None:
        super().__init__()
        self.group_size, self.rank = group_size, rank
        self.calls: dict[str, list[int]] = {}  # op -> S in bytes of each call
        self.unsized: dict[str, int] = {}

    def __enter__(self) -> CommCounter:
        self.comm_counts.clear()
        self.calls.clear()
        self.unsized.clear()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args: Any) -> None:
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in self.comm_registry or packet in c10d_collective_ops:
            self.comm_counts[NATIVE_TO_PY_MAPPING.get(packet, packet)] += 1
            self._record(packet, args)
        return out

    def _record(self, packet: Any, args: tuple) -> None:
        name = packet.__name__
        if name not in _COLLECTIVES:
            self.unsized[name] = self.unsized.get(name, 0) + 1
            return
        op, arg, is_chunk = _COLLECTIVES[name]
        tensor = args[arg]
        nbytes = tensor.numel() * tensor.element_size()
        self.calls.setdefault(op, []).append(nbytes * (self.group_size if is_chunk else 1))

    def bytes_sent(self) -> int:
        return sum(
            native_traffic(op, s, self.group_size, self.rank).sent
            for op, sizes in self.calls.items()
            for s in sizes
        )

    def summary(self) -> dict[str, dict[str, int]]:
        """{op: {calls, bytes_sent}} for this rank, like our ledger's totals."""
        out = {}
        for op, sizes in sorted(self.calls.items()):
            sent = sum(native_traffic(op, s, self.group_size, self.rank).sent for s in sizes)
            out[op] = {"calls": len(sizes), "bytes_sent": sent}
        for name, n in self.unsized.items():
            out[name] = {"calls": n, "bytes_sent": 0}
        return out
