"""How one rank computes a step's gradients, whatever the layout.

An engine holds this rank's part of the model (all of it, or its pipeline stage's chunks),
each piece wrapped for data parallelism (a `Replica`: plain, ZeRO 1-2, FSDP, with or
without mixed precision). After `forward_backward` the gradients are the global batch's
sums over tokens, reduced over dp (whole or sharded), and the return value is its mean
token loss. The engine owes them 1 / tokens (`owed`), which `grad_norm` counts and
`settle_grads` pays, times the clip's factor, in one pass over the gradients, as a plain
loop makes one (the clip's; docs/benchmarks.md, the overhead bench on an Intel Xeon). The
engine asks its replicas only what the `Replica` protocol offers, so `grad_norm`, the
optimizer, the memory report and checkpoints work the same for all.

Tensor parallelism is applied to the model before an engine sees it; the engines only
finish what sequence parallelism leaves partial (LayerNorm gradients summed over tp).

- FlatEngine (pp = 1): micro-batches in turn, token-weighted, one gradient sync per step.
- PipelineEngine (pp > 1): the pipeline runtime runs the schedule over the pp group; the
  dp reduction of each chunk's gradients runs once, after the schedule ends; weights tied
  between the first and the last stage are then summed between them.

Under context parallelism (cp > 1) each engine feeds the model its rank's chunks of every
micro-batch (`split`, a TokenShard) and its replicas' group is dp_cp: the ranks that hold
the same parameters and different tokens; `dp` stays the group whose ranks take
different batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from paratrain import comm
from paratrain.models.moe import moe_layers
from paratrain.parallel.compile import CompiledBlocks
from paratrain.parallel.context_parallel import TokenShard
from paratrain.parallel.data_parallel.muon_math import MuonSettings
from paratrain.parallel.data_parallel.replica import GradSquares, Replica
from paratrain.parallel.pipeline import PipelineRuntime, TiedWeights
from paratrain.parallel.tensor_parallel.rng import RngTracker
from paratrain.parallel.tensor_parallel.state import (
    sequence_parallel_parameters,
    sharded_parameters,
)
from paratrain.token_rows import IGNORE_INDEX
from paratrain.train.clip import global_grad_norm
from paratrain.train.microbatch_passes import WHOLE, accumulate_gradients, evaluate
from paratrain.train.optim import OptimizerSet

STATE_KINDS = ("params", "grads", "optimizer", "master")  # the planner's model-state kinds


class Engine:
    """What FlatEngine and PipelineEngine share: everything but computing the gradients."""

    def __init__(self, replicas: list[Replica], tp: comm.CommGroup, pp: comm.CommGroup | None):
        self.replicas, self.tp, self.pp = replicas, tp, pp
        self.runtime: PipelineRuntime | None = None
        self.rng_tracker: RngTracker | None = None  # tensor parallelism's dropout streams
        self.compiled: CompiledBlocks | None = None  # --compile: what was compiled, counted
        self._tp_split = {n for r in replicas for n in sharded_parameters(r.module)}
        self._partial = []  # per replica: names whose gradients sequence parallelism splits
        for r in replicas:
            partial = {id(p) for p in sequence_parallel_parameters(r.module)}
            self._partial.append([n for n, p in r.module.named_parameters() if id(p) in partial])
        # Once, not a traversal of every module twice per step; none for a dense model.
        self.moe_layers = [layer for m in self.modules for layer in moe_layers(m)]
        self.owed = 1.0  # the factor the gradients still owe their mean: 1 / tokens

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        """This step's gradients, reduced, as sums over tokens (`owed` set to 1 / tokens);
        returns (mean loss, tokens)."""
        raise NotImplementedError

    def settle_grads(self, factor: float = 1.0) -> None:
        """Scale the gradients by what they owe times `factor` (the clip's coefficient,
        fault tolerance's weight of this group), in one pass."""
        total, self.owed = self.owed * factor, 1.0
        if total != 1.0:
            for r in self.replicas:
                r.scale_grads_(total)

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over the scored tokens of the held-out batches."""
        raise NotImplementedError

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's modules, each once (expert parallelism wraps one module twice)."""
        seen: dict[int, nn.Module] = {}
        for r in self.replicas:
            seen.setdefault(id(r.module), r.module)
        return list(seen.values())

    @property
    def loss_scaled(self) -> bool:
        """fp16: a step whose gradients overflowed is the loss scaler's to skip."""
        return any(r.scaler is not None for r in self.replicas)

    def build_optimizer(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        muon: MuonSettings | None = None,
        sgd: bool = False,
    ) -> OptimizerSet:
        """AdamW (or, with `muon`, Muon and AdamW; with `sgd`, plain SGD) over what each
        replica updates."""
        optimizers = [
            r.build_optimizer(lr, weight_decay, betas, muon=muon, tp=self.tp, sgd=sgd)
            for r in self.replicas
        ]
        return OptimizerSet(optimizers)

    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradient's mean (what it owes applied), the
        same on every rank."""
        norm = global_grad_norm(self._grad_squares(), self._tp_split, self.tp, self.pp)
        return norm * self.owed

    def _grad_squares(self) -> list[GradSquares]:
        return [r.grad_squares() for r in self.replicas]

    def _complete_partial_grads(self) -> None:
        """Sum over tp the gradients that sequence parallelism left partial (after the dp
        reduction: sums commute)."""
        if self.tp.size > 1:
            for r, names in zip(self.replicas, self._partial, strict=True):
                if names:
                    r.all_reduce_grads_(names, self.tp)

    def memory_report(self, optimizer: OptimizerSet) -> dict[str, int]:
        """Bytes of model state held on this rank at the step boundary, by the planner's
        kinds (padding counted with the parameters; AdamW's step counters left out;
        DiLoCo's global parameters as master, its outer momentum as optimizer state)."""
        totals = dict.fromkeys(STATE_KINDS, 0)
        for r, opt in zip(self.replicas, optimizer.optimizers, strict=True):
            report = r.memory_report(opt)
            for kind in STATE_KINDS:
                totals[kind] += getattr(report, kind)
            totals["params"] += report.padding
        if optimizer.outer is not None:  # DiLoCo's global copy (master) and outer momentum
            for kind, nbytes in optimizer.outer.memory().items():
                totals[kind] += nbytes
        return totals

    def finish(self) -> None:
        """After the last step: leave every module whole (ZeRO-3 gathers its units)."""
        for r in self.replicas:
            r.materialize()


class FlatEngine(Engine):
    """The whole depth of the model on this rank: one replica, which runs the forward, and
    under expert parallelism `more` over the same module, each holding its own share of
    the parameters (train/experts.py)."""

    def __init__(
        self,
        replica: Replica,
        tp: comm.CommGroup | None = None,
        split: TokenShard = WHOLE,
        dp: comm.CommGroup | None = None,
        more: Sequence[Replica] = (),
        held_out: comm.CommGroup | None = None,
    ) -> None:
        """dp: the group whose ranks take different batches (default: the replica's);
        under cp the replica's group is dp_cp and dp the ranks of this cp coordinate.
        held_out: the ranks evaluation sums over (default the replica's; DiLoCo's groups,
        one model again at the end, evaluate over all of dp_cp)."""
        super().__init__([replica, *more], tp or replica.group.alone("tp"), None)
        self.replica, self.split, self.dp = replica, split, dp or replica.group
        self.held_out = held_out or replica.group

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        for r in self.replicas:
            r.zero_grad()
        others = self.replicas[1:]
        loss, tokens = accumulate_gradients(self.replica, micro_batches, self.split, others)
        self._complete_partial_grads()
        scale = self.replica.scaler.scale if self.replica.scaler is not None else 1.0
        self.owed = 1.0 / (max(tokens, 1) * scale)  # sums -> the mean, when settled
        return loss, tokens

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        # Through the wrapper: under ZeRO-3 the module alone holds no parameters.
        return evaluate(self.replica, batches, self.dp, self.split, self.held_out)


class PipelineEngine(Engine):
    """This stage's chunks, each its own replica, run by the pipeline runtime; under
    expert parallelism `more` holds the chunks' experts (train/experts.py)."""

    runtime: PipelineRuntime  # never None here

    def __init__(
        self,
        replicas: list[Replica],
        runtime: PipelineRuntime,
        tp: comm.CommGroup,
        tied: TiedWeights | None = None,
        ends: comm.CommGroup | None = None,
        dp: comm.CommGroup | None = None,
        more: Sequence[Replica] = (),
        held_out: comm.CommGroup | None = None,
    ) -> None:
        """dp and held_out: as FlatEngine's; the runtime's `split` gives this rank's tokens. Every
        replica sums over its group (`more`, the split experts, over expert_dp), and the
        engine divides the sums by the global batch's target tokens."""
        super().__init__([*replicas, *more], tp, runtime.group)
        self.chunk_replicas, self.more = replicas, list(more)
        self.runtime, self.tokens_group = runtime, replicas[0].group
        self.dp = dp or self.tokens_group
        self.held_out = held_out or self.tokens_group
        self.device = runtime.device  # the dp reduction of the loss runs where it lives
        self.tied = tied or TiedWeights()
        self.ends = ends  # the first and the last stage, if this rank is one of them

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[float, int]:
        for r in self.replicas:
            r.zero_grad()
        # Each micro-batch weighs its target tokens (this rank's, under cp its chunks'): the
        # gradients hold sums over tokens, as the flat engine's, divided below by the global
        # batch's count, which a loss mask makes differ between micro-batches and replicas.
        counts = [int((self.runtime.split(b)[1] != IGNORE_INDEX).sum()) for b in micro_batches]
        with contextlib.ExitStack() as stack:
            for r in self.replicas:  # one dp reduction per chunk, after the whole schedule
                stack.enter_context(r.no_sync())
            loss_sum = self.runtime.run_step(micro_batches, [float(n) for n in counts])
        for r in self.replicas:
            r.finish_gradient_sync()
        self._complete_partial_grads()
        self._sum_tied_grads()
        stats = torch.tensor([loss_sum, sum(counts)], dtype=torch.float64, device=self.device)
        comm.all_reduce(stats, self.tokens_group, op="sum")
        tokens = int(stats[1])
        self.owed = 1.0 / max(tokens, 1)  # sums -> the mean (the split experts' too: grads.py)
        return float(stats[0]) / max(tokens, 1), tokens

    def _sum_tied_grads(self) -> None:
        if not self.tied or self.ends is None:
            return
        first = self.runtime.stage == 0  # holds virtual stage 0 as its chunk 0
        replica = self.chunk_replicas[0] if first else self.chunk_replicas[-1]
        names = self.tied.first if first else self.tied.last
        replica.all_reduce_grads_(list(names), self.ends, same_layout=False)

    def _grad_squares(self) -> list[GradSquares]:
        parts = super()._grad_squares()
        if self.tied and self.ends is not None and self.runtime.stage != 0:
            last = len(self.chunk_replicas) - 1  # the last chunk's dense replica
            parts[last] = _without(parts[last], set(self.tied.last))  # counted on the first stage
        return parts

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over the scored tokens. The runtime weights its micro-batches equally,
        so only full batches of one shape run together; a padded one runs alone.

        Under expert parallelism each forward is an all-to-all over ep, whose ranks take
        different batches: every rank runs the same number of one-batch passes, and one
        short of batches repeats one with weight 0 (as passes.evaluate does)."""
        mine = batches[self.dp.rank :: self.dp.size]
        runs = [(group, True) for group in _equally_weighted(mine)]
        if self.more:
            rounds = -(-len(batches) // self.dp.size)
            runs = [([b], True) for b in mine] + [([batches[0]], False)] * (rounds - len(mine))
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for group, counted in runs:
            targets = [self.runtime.split(b)[1] for b in group]  # this rank's chunks
            tokens = sum(int((t != IGNORE_INDEX).sum()) for t in targets) if counted else 0
            loss = self.runtime.run_forward(group)  # every rank runs it: collectives
            if tokens:  # a cp chunk of padding alone has a NaN mean, and weight 0
                stats[0] += loss * tokens
                stats[1] += tokens
        comm.all_reduce(stats, self.held_out, op="sum")
        return float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")


def _equally_weighted(batches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Runs of full batches of one shape, and each padded batch on its own."""
    groups: list[list[torch.Tensor]] = []
    joinable = False  # the last group is full batches
    for b in batches:
        full = not bool((b < 0).any())  # every token a target (token_rows.py)
        if full and joinable and groups[-1][0].shape == b.shape:
            groups[-1].append(b)
        else:
            groups.append([b])
        joinable = full
    return groups


def _without(part: GradSquares, names: set[str]) -> GradSquares:
    keep = [i for i, n in enumerate(part.names) if n not in names]
    return replace(part, names=[part.names[i] for i in keep], squares=part.squares[keep])
