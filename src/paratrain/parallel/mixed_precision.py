"""Mixed precision: 16-bit compute copies, fp32 master weights and moments, loss scaling.

The accounting the seeds use (definition 9.2.3) and ZeRO (arXiv:1910.02054, section 3.1)
derives: per parameter 2 bytes of bf16/fp16 weights and 2 of gradients for compute, plus
4 of fp32 master weights and 4 + 4 of fp32 Adam moments, 16 bytes in all. The optimizer
updates the fp32 master copy (small updates would vanish below a 16-bit weight's
precision, Micikevicius et al., arXiv:1710.03740, section 3.1) and the 16-bit copy is
refreshed from it after every step.

fp16's narrow exponent lets small gradients underflow to zero, so fp16 needs loss scaling
(arXiv:1710.03740, section 3.2): the backward pass starts from loss * scale, the gradients
are divided by the scale before the update, and a step whose gradients overflowed is
skipped and the scale halved; after `growth_interval` good steps the scale doubles
(dynamic scaling, as torch.amp.GradScaler does). bf16 has fp32's exponent and needs none.

`float32` keeps everything in fp32 with no separate master copy (4 + 4 + 8 = 16 bytes per
parameter with Adam): what equivalence tests and CPU benchmarks use, since a bf16 matrix
product is about 50 times slower than fp32 on these CPUs.

Gradients are reduced in `reduce_dtype` (fp32 by default, so that summing k replicas'
16-bit gradients does not round at every addition); the reduced value is stored back in
the gradient's own dtype, which is what the memory formulas count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from paratrain import comm
from paratrain.config import COMPUTE_DTYPES, DTYPE_SHORT_NAMES

DTYPES: dict[str, torch.dtype] = {  # each compute dtype under its torch name and short name
    name: getattr(torch, full)
    for full in COMPUTE_DTYPES
    for name in (full, DTYPE_SHORT_NAMES[full])
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class MixedPrecision:
    """What each kind of model state is stored and communicated in.

    param_dtype: the compute copy of the weights and the gradients autograd produces.
    reduce_dtype: gradients are converted to this for the reduction (fp32 by default).
    Master weights and optimizer moments are always fp32; a separate master copy exists
    only when param_dtype is not fp32.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    initial_loss_scale: float = 2.0**16  # fp16 only
    growth_interval: int = 2000  # fp16 only: good steps before the scale doubles

    @classmethod
    def of(
        cls, dtype: str | torch.dtype, reduce_dtype: str | torch.dtype = "float32"
    ) -> MixedPrecision:
        """MixedPrecision.of("bfloat16"): the usual policy for a compute dtype."""
        return cls(parse_dtype(dtype), parse_dtype(reduce_dtype))

    def __post_init__(self) -> None:
        for dt in (self.param_dtype, self.reduce_dtype):
            if dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"dtype {dt}; valid: float32, bfloat16, float16")

    @property
    def has_master(self) -> bool:
        """A separate fp32 master copy: only when the compute copy is 16-bit."""
        return self.param_dtype != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16

    @property
    def param_bytes(self) -> int:
        return self.param_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.reduce_dtype.itemsize


class DynamicLossScaler:
    """The fp16 loss scale: halve and skip on overflow, double after a run of good steps."""

    def __init__(self, initial: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.skipped = 0  # steps skipped because the gradients overflowed

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            self.skipped += 1
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs to skip and grow as the uninterrupted one would."""
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])


class _ScaleBackward(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by `scale` in backward.

    Applied to the model's output, it makes backward start from (loss * scale) without
    changing the loss value the training loop reads and logs.
    """

    apply: ClassVar[Callable[[torch.Tensor, float], torch.Tensor]]  # (torch: untyped)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_backward(output: object, scale: float) -> object:
    """Scale the gradient flowing back into every float tensor of a module's output."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad and output.is_floating_point():
            return _ScaleBackward.apply(output, scale)
        return output
    if isinstance(output, tuple | list):
        return type(output)(scale_backward(o, scale) for o in output)
    return output


def found_inf(grads: list[torch.Tensor], group: comm.CommGroup) -> bool:
    """Whether any rank's gradient has an inf or nan (one small all-reduce over the group)."""
    flag = torch.zeros(1, device=grads[0].device if grads else group.device)
    for g in grads:
        if g.numel() and not bool(torch.isfinite(g).all()):
            flag.fill_(1.0)
            break
    comm.all_reduce(flag, group, op="max")
    return bool(flag.item() > 0)
