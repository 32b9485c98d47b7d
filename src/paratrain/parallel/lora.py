"""LoRA applied from outside: low-rank adapters on a plain model's linear layers.

    model = build(...)                                   # full model, same seed on every rank
    apply_lora(model, ("blocks.*.attn.q", ...), rank=16, alpha=32, seed=cfg.train.seed)

LoRA (Hu et al., arXiv:2106.09685, section 4.1) freezes the pretrained weight W0 of each
target layer and learns a low-rank update: h = W0 x + (alpha / r) B A x, with A (r, in)
and B (out, r). A starts as nn.Linear's default (Kaiming uniform, a = sqrt(5), as PEFT
initialises it) and B at zero, so the adapted model starts equal to the base. Every base
parameter is frozen (requires_grad False): it gets no gradient, so the data-parallel
wrappers neither reduce it nor give it optimizer state (their ParamShare holds only
parameters that train); DP and ZeRO-1/2 keep it whole on every rank, ZeRO-3 shards it
and gathers it with its unit (data_parallel/fsdp.py).

Each target becomes a `LoraLinear`, an nn.Linear that keeps the base's `weight` and `bias`
(the same Parameter objects) and adds `lora_A` and `lora_B`: the state-dict keys are the
base's plus PEFT's (`blocks.0.attn.q.lora_A.weight`), so a base checkpoint loads under
the same names and the adapters map one to one onto a PEFT adapter file. The adapters are
drawn from a generator seeded by `seed` alone, in module order, on the CPU: every rank,
and a model whose base came from a checkpoint (--init-from), builds the same ones.

Tensor parallelism then slices a LoraLinear like any linear layer and splits its adapters
consistently (`split_lora`); its layers add theirs to their output (`with_lora`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.module_names import matching


def _undrawn_linear(
    in_features: int, out_features: int, device: torch.device, dtype: torch.dtype
) -> nn.Linear:
    """A Linear without bias whose weight is allocated, not drawn: no draw from the
    process's random stream (the run's is left alone; an initialisation on the meta
    device draws nothing). Built there and given its weight, not moved (`skip_init`
    moves it, which fake tensors refuse: simulate/)."""
    layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
    return layer


class LoraLinear(nn.Linear):
    """base(x) + scaling * lora_B(lora_A(x)), base frozen; built around an nn.Linear."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        nn.Module.__init__(self)  # not nn.Linear's: the base's parameters are kept, not drawn
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        device, dtype = base.weight.device, base.weight.dtype
        a = torch.empty(rank, base.in_features, device="cpu")  # the same on every device
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = _undrawn_linear(base.in_features, rank, device, dtype)
        self.lora_B = _undrawn_linear(rank, base.out_features, device, dtype)
        with torch.no_grad():
            if device.type != "meta":
                self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        return add_update(base, x, self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, lora_alpha={self.alpha}"

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same: W0 + scaling * B A (its own tensors)."""
        w = self.weight.detach()
        a, b = self.lora_A.weight.detach(), self.lora_B.weight.detach()
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w.device, dtype=w.dtype)  # fmt: skip
        with torch.no_grad():
            out.weight.copy_(merged_weight(w, a, b, self.scaling))
            if self.bias is not None:
                out.bias.copy_(self.bias.detach())
        return out


def merged_weight(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """W0 + scaling * B A, computed in float64 and returned in W0's dtype (rounded once)."""
    delta = b.double() @ a.double()  # (out, r) @ (r, in)
    return (w.double() + scaling * delta).to(w.dtype)


def merge_lora_weights(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state (base and `<layer>.lora_A.weight`, `.lora_B.weight` under the
    plain model's names) as the plain model's: every adapter folded into its base weight."""
    out = {k: t for k, t in tensors.items() if ".lora_" not in k}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            layer = key.removesuffix(".lora_A.weight")
            a, b = tensors[key], tensors[f"{layer}.lora_B.weight"]
            out[f"{layer}.weight"] = merged_weight(tensors[f"{layer}.weight"], a, b, scaling)
    return out


def lora_targets(model: nn.Module, patterns: Sequence[str], rank: int) -> list[str]:
    """The names of the linear layers `patterns` match, in module order; ValueError, naming
    the pattern or the layer and its sizes, when a pattern matches nothing, a match is not
    a linear layer, or the rank is not below what the layer can hold (1 <= r <= min(in, out))."""
    if rank < 1:
        raise ValueError(f"--lora-rank {rank}: must be 1 or more")
    names: list[str] = []
    for pattern in patterns:
        hits = matching(model, pattern)
        if not hits:
            raise ValueError(
                f"--lora-targets {pattern!r} matches no module of the model "
                "(module-name patterns as in models/plans.py, e.g. blocks.*.attn.q)"
            )
        for name in hits:
            module = model.get_submodule(name)
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"--lora-targets {pattern!r} matches {name}, a {type(module).__name__}; "
                    "LoRA adapts linear layers only"
                )
            most = min(module.in_features, module.out_features)
            if rank > most:
                raise ValueError(
                    f"--lora-rank {rank} exceeds {name}'s {module.in_features} -> "
                    f"{module.out_features} (at most {most})"
                )
            if name not in names:
                names.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(names, key=order.__getitem__)


def apply_lora(
    model: nn.Module, patterns: Sequence[str], rank: int, alpha: float, seed: int
) -> list[str]:
    """Freeze `model` and give each linear layer `patterns` match adapters (in place);
    return the adapted layers' names. Raises ValueError as `lora_targets` does, or for
    alpha <= 0."""
    if not alpha > 0:
        raise ValueError(f"--lora-alpha {alpha}: must be positive")
    names = lora_targets(model, patterns, rank)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent, _, child = name.rpartition(".")
        base = model.get_submodule(name)
        assert isinstance(base, nn.Linear)  # lora_targets checked
        setattr(model.get_submodule(parent), child, LoraLinear(base, rank, alpha, generator))
    return names


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters in the compute dtype (in place): under mixed precision the
    wrappers cast the parameters they train and keep fp32 masters of them; a frozen one
    never changes, so its 16-bit copy is all it needs (2 bytes a parameter in bf16)."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def split_lora(lora: LoraLinear, layer: nn.Module, style: str, rank: int, size: int) -> None:
    """Give `layer`, the tensor-parallel slice (rank of size) of `lora`'s base, the
    adapters split consistently with it (Megatron's layout, arXiv:1909.08053):

    colwise (output features split): B by its output rows, A whole: the rank computes its
        slice of B (A x) from the whole input; A's gradient is partial (its rows of B).
    rowwise (input features split): A by its input columns, B whole: B (A_r x_r) is this
        rank's partial output, summed with the base's by the same all-reduce (g); B's
        gradient is partial (from A_r x_r).

    A partial gradient is summed over tp by the training step, as sequence parallelism's
    are (`sequence_parallel_params`); a split one is placed by `tp_shard_dims`."""
    a, b = lora.lora_A, lora.lora_B
    whole, split, dim = (a, b, 0) if style == "colwise" else (b, a, 1)
    n = split.weight.shape[dim] // size
    part = split.weight.detach().narrow(dim, rank * n, n).clone()  # (out/tp, r) or (r, in/tp)
    sliced = nn.Linear(part.shape[1], part.shape[0], bias=False, device="meta")  # no draw
    sliced.weight = nn.Parameter(part)  # given, not moved (fake tensors refuse: simulate/)
    sliced.tp_shard_dims = {"weight": dim}  # type: ignore[assignment]  # read by tp's state
    whole.sequence_parallel_params = ("weight",)  # type: ignore[assignment]  # summed over tp
    layer.lora_A, layer.lora_B = (whole, sliced) if style == "colwise" else (sliced, whole)
    layer.lora_scaling = lora.scaling  # type: ignore[assignment]  # read by with_lora


def add_update(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """y + scaling B (A x), for y (..., out), x (..., in), A (r, in), B (out, r). The scaling
    goes on the small B, and the second product adds into y itself (addmm, beta 1), so
    that no elementwise pass over the (tokens, out) output is added: measured on the
    default GPT on 2 cores, a separate multiply and add were a third of LoRA's extra time
    per step."""
    low = F.linear(x, a).reshape(-1, a.shape[0])  # (tokens, r)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), low, (b * scaling).t())  # (tokens, out)
    return out.view(y.shape)


def with_lora(layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y + scaling B (A x) for a tensor-parallel layer that `split_lora` adapted (its A
    and B this rank's slices); y itself for any other."""
    scaling: float = getattr(layer, "lora_scaling", 0.0)
    if not scaling:
        return y
    a, b = layer.get_parameter("lora_A.weight"), layer.get_parameter("lora_B.weight")
    return add_update(y, x, a, b, scaling)


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (in place): the plain model again, computing
    what the adapted one did, under the plain model's names. Return it."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.merged())
    return model
