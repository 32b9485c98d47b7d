"""Forward and backward passes over a step's micro-batches, weighted by tokens.

Token weighting: each micro-batch contributes the sum of its token losses, and the summed
gradients (over micro-batches and, by the dp all-reduce, over replicas) are divided by the
number of target tokens in the whole global batch. The step therefore equals one step on
all K * b * dp sequences at once even when micro-batches hold different numbers of tokens
(targets equal to IGNORE_INDEX are masked out and do not count).

Under context parallelism each rank of a cp group sees its chunks of the same micro-batch
(`split`, a TokenShard): its loss sum and token count are its chunks', and the sums over
the group that holds the same parameters (dp_cp: the wrapper's group) are the batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from paratrain import comm
from paratrain.parallel.context_parallel import TokenShard
from paratrain.token_rows import IGNORE_INDEX

WHOLE = TokenShard()  # cp = 1: every token of the micro-batch


def accumulate_gradients(
    model: Any,
    micro_batches: list[torch.Tensor],
    split: TokenShard = WHOLE,
    others: Sequence[Any] = (),
) -> tuple[float, int]:
    """Forward and backward of the micro-batches, one gradient sync, the global token count.

    `model` is any data-parallel wrapper (forward, no_sync, finish_gradient_sync, group);
    `others` wrap the same module's other parameters (expert parallelism's experts) and
    sync with it.
    Returns (mean token loss over the global batch, target tokens in the global batch); the
    gradients still hold sums over tokens: the caller scales them by 1 / tokens.
    No micro-batch is skipped, even one with no target tokens: sharded wrappers communicate
    in every pass, so all ranks must run the same passes. Such a batch runs with its loss
    multiplied by 0 (targets clamped to a valid id, so the zero is exact, not 0 * nan).
    """
    # (sum of token losses, tokens) on this rank, beside the losses
    sums = torch.zeros(2, dtype=torch.float64, device=micro_batches[0].device)
    last = len(micro_batches) - 1
    counted: comm.Pending | None = None
    for i, batch in enumerate(micro_batches):
        inputs, targets = split(batch)  # (b, T/cp) each; padding fed as token 0
        tokens = int((targets != IGNORE_INDEX).sum())
        if tokens == 0:
            targets = targets.clamp(min=0)
        # Only the last micro-batch's backward triggers the gradient sync.
        with contextlib.ExitStack() as sync:
            if i != last:
                for wrapper in (model, *others):
                    sync.enter_context(wrapper.no_sync())
            mean_loss = model(inputs, targets, **split.keywords(batch))
            sums[0] += mean_loss.detach().double() * tokens
            sums[1] += tokens
            if i == last:  # complete: reduced behind the last backward, not after it
                counted = comm.all_reduce(sums, model.group, op="sum", async_op=True)
            (mean_loss * tokens).backward()
    for wrapper in (model, *others):
        wrapper.finish_gradient_sync()
    assert counted is not None  # the last micro-batch launched it
    counted.wait()
    total_tokens = max(1.0, float(sums[1]))
    return float(sums[0]) / total_tokens, int(sums[1])


class Evaluated(Protocol):
    """A model, or a replica of one (all are modules): model(inputs, targets) is the loss."""

    training: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@torch.no_grad()
def evaluate(
    model: Evaluated,
    batches: list[torch.Tensor],
    dp_group: comm.CommGroup,
    split: TokenShard = WHOLE,
    sum_group: comm.CommGroup | None = None,
) -> float:
    """Mean token loss over the held-out batches; replica r takes batches r, r + dp, ...

    Every replica runs the same number of forward passes (a replica short of batches
    repeats one with weight 0): under ZeRO-3 each forward is a collective. Under context
    parallelism the ranks of a dp coordinate take the same batches, each its chunks
    (`split`), and the sums run over `sum_group` (dp_cp; default dp_group).
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=batches[0].device)  # (loss * tokens, tokens)
    rounds = -(-len(batches) // dp_group.size)  # ceil
    for i in range(rounds):
        index = dp_group.rank + i * dp_group.size
        batch = batches[index] if index < len(batches) else batches[0]
        inputs, targets = split(batch)
        tokens = int((targets != IGNORE_INDEX).sum()) if index < len(batches) else 0
        if tokens == 0:  # a pass for the collectives only: a finite loss, weight 0
            targets = targets.clamp(min=0)
        loss = model(inputs, targets, **split.keywords(batch))
        sums[0] += loss.double() * tokens
        sums[1] += tokens
    comm.all_reduce(sums, sum_group or dp_group, op="sum")
    model.train(was_training)
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
