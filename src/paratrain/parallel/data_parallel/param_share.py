"""Which of its module's parameters a data-parallel wrapper holds (replica.py's protocol
is otherwise the same): all of them, or, under expert parallelism, the experts in one
wrapper and the rest in another over the same module (train/experts.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paratrain.comm.group import CommGroup


@dataclass(frozen=True)
class ParamShare:
    """Which of its module's parameters a data-parallel wrapper holds and reduces over its
    group. Every parameter by default; under expert parallelism one wrapper holds the
    experts (over the expert-dp group) and another the rest (over dp): train/build.py.

    names: the parameters (as the module names them); None: all of them.
    split_over: the ranks that hold different parameters under these names (the ep
        group, each rank its own experts): squares of their gradients add in the norm.
    units: ZeRO-3's units for this share (module names per unit, as the model plan's
        `fsdp_units`); None: the plan's. The experts gather by their own modules: a
        block's unit holds only the dense part of the block.
    """

    names: frozenset[str] | None = None
    split_over: CommGroup | None = None
    units: tuple[tuple[str, ...], ...] | None = None

    def named(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters of this share that train, in the module's order."""
        return [
            (n, p)
            for n, p in module.named_parameters()
            if p.requires_grad and (self.names is None or n in self.names)
        ]

    def frozen(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters of this share that do not train (a LoRA run's base)."""
        return [
            (n, p)
            for n, p in module.named_parameters()
            if not p.requires_grad and (self.names is None or n in self.names)
        ]


EVERY_PARAMETER = ParamShare()
