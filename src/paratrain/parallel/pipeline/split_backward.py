"""A backward split in two for zero-bubble schedules: dL/dx first, dL/dW later, each op once.

ZB-H1 (arXiv:2401.10241, section 2) runs a micro-batch's backward as two actions: BI, the
gradient of the stage input, which the previous stage waits for, and BW, the weight
gradients, which nobody waits for and which therefore fill the bubble.

The graph from the output y down to the input x is the *input path*. A node on it that also
feeds a weight (the matmul of a Linear, a LayerNorm) is a *weight consumer*: there the two
passes meet. Before: BW called autograd.grad(y, weights) and walked the whole input path a
second time, recomputing every activation gradient that BI had computed. Now:

- BI: one autograd.grad towards x, which also asks for each consumer's incoming gradient dY
  (a GradientEdge input: autograd keeps it as it passes). Only the input path runs, and a
  consumer computes only its outputs towards x (autograd masks the others: a Linear's node
  computes dX = dY W, not dW).
- BW: from the consumers, seeded with their dY, backward to their weights only: a consumer
  runs again for its weight outputs (dW = dY^T X), then what lies between it and the
  weight (a transpose, the accumulation into .grad).

So every matmul of a backward runs exactly once, and every node but the consumers once; the
consumers run once per pass, for disjoint outputs. BW cannot be one autograd call: from
layer 2's consumer to all weights, autograd would walk down the input path to layer 1's.
Weights with the same consumers form a group, and groups whose consumers lie at the same
depth of the input path (q, k, v) share a call. torch.distributed.pipelining's
stage_backward_input / stage_backward_weight split the same way, one call per group. The
price: each consumer's dY is held from BI to BW, and a Python walk of the graph per BI. A
weight used at two places of the input path (tied within one chunk) is the exception: its
call also walks the input path between the two uses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from paratrain.comm import compat


@dataclass
class _Group:
    """Weights whose gradients leave the input path through the same consumers."""

    consumers: list[Node]
    params: list[torch.Tensor]


@dataclass
class _Call:
    """One autograd call of BW: from consumers' edges, seeded with their dYs, to weights."""

    edges: list[GradientEdge] = field(default_factory=list)
    seeds: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    resets: list[tuple[Node, dict[int, torch.Tensor]]] = field(default_factory=list)


class WeightGrad:
    """BW's work, kept by BI: `run()` accumulates the weight gradients into `.grad`, as a
    plain backward would (post-accumulate hooks fire), and can run once."""

    def __init__(self, calls: list[_Call], retain_graph: bool = False) -> None:
        self._calls, self._retain = calls, retain_graph

    def run(self) -> None:
        calls, self._calls = self._calls[::-1], []
        # One recomputation of a checkpointed region (use_reentrant=False) for all of
        # BW's calls, not one per call: they share one graph-exec group, which requires
        # that no two of them run the same node; a weight used twice breaks that.
        with contextlib.nullcontext() if self._retain else compat.graph_exec_group():
            self._run(calls)

    def _run(self, calls: list[_Call]) -> None:
        while calls:
            call = calls.pop()  # its graph and dYs go when the next call starts
            # A consumer reached from another of its group (a weight used twice) would
            # count twice: pre-hooks reset its input to the dY that BI kept.
            handles = [
                n.register_prehook(functools.partial(_reset, kept)) for n, kept in call.resets
            ]
            try:
                torch.autograd.backward(
                    call.edges, call.seeds, retain_graph=self._retain, inputs=call.params
                )
            finally:
                for handle in handles:
                    handle.remove()


def _reset(
    kept: dict[int, torch.Tensor], grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...]:
    return tuple(kept.get(i, g) for i, g in enumerate(grads))


class _PlainBackward(WeightGrad):
    """When the stage input needs no gradient (token ids), BW is the whole backward."""

    def __init__(self, y: torch.Tensor, grad: torch.Tensor | None) -> None:
        super().__init__([])
        self._y: torch.Tensor | None = y
        self._grad = grad

    def run(self) -> None:
        y, grad, self._y, self._grad = self._y, self._grad, None, None
        if y is not None:
            torch.autograd.backward(y, grad)


def backward_input(
    y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, WeightGrad]:
    """dL/dx for the output gradient `grad` (None: y is the loss), and BW's work to come.

    Without a gradient for x (x needs none: token ids) nothing runs now and BW is a plain
    backward.
    """
    if not x.requires_grad:
        return None, _PlainBackward(y, grad)
    assert y.grad_fn is not None, "the stage output does not depend on anything trainable"
    parents = _parents(y.grad_fn, y.output_nr)
    input_path = _reaching(get_gradient_edge(x).node, parents)
    groups = _weight_groups(params, parents, input_path)
    # Each consumer's dY is asked for as one more input of the same call: autograd keeps
    # it as it passes, in C++, and still runs the consumer for dL/dx. The graph is kept:
    # the consumers' saved inputs (X of dW = dY^T X) serve BW.
    slots = [(g, n, i) for g in groups for n in g.consumers for i in sorted(parents[n][1])]
    edges = [GradientEdge(n, i) for _, n, i in slots]
    gx, *kept = torch.autograd.grad(
        y,
        [x, *edges],  # type: ignore[arg-type]  # torch takes both kinds at once; its stub, not
        grad,
        retain_graph=True,
        allow_unused=True,
    )
    assert gx is not None, "the stage output does not depend on the stage input"
    # Groups whose consumers lie at the same depth of the input path (q, k and v) cannot
    # reach each other's weights: they share one call. A longer path between consumers
    # than between their depths is impossible, so equal depths mean no path at all.
    depth = _depths(y.grad_fn, parents, input_path)
    calls: dict[object, _Call] = {}
    call_of: dict[int, _Call] = {}
    for g in groups:
        key = id(g) if len(g.consumers) > 1 else depth[g.consumers[0]]
        call_of[id(g)] = call = calls.setdefault(key, _Call())
        call.params += g.params
    for (g, n, i), dy in zip(slots, kept, strict=True):
        if dy is not None:
            call = call_of[id(g)]
            call.edges.append(GradientEdge(n, i))
            call.seeds.append(dy)
            if len(g.consumers) > 1:
                call.resets.append((n, {i: dy}))
    used = [c for c in calls.values() if c.edges]  # no dY reached them: no weight gradient
    return gx, WeightGrad(used, retain_graph=any(c.resets for c in used))


def _parents(root: Node, slot: int) -> dict[Node, tuple[list[Node], set[int]]]:
    """Every node reachable from `root`: the nodes that pass it a gradient, and the slots
    (its forward outputs) that receive one; `slot` is the root's."""
    parents: dict[Node, tuple[list[Node], set[int]]] = {root: ([], {slot})}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, i in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = ([], set())
                stack.append(child)
            parents[child][0].append(node)
            parents[child][1].add(i)
    return parents


def _reaching(target: Node, parents: dict[Node, tuple[list[Node], set[int]]]) -> set[Node]:
    """`target` and every node with a path down to it: the input path when target is x's."""
    seen = {target} if target in parents else set()
    stack = list(seen)
    while stack:
        for parent in parents[stack.pop()][0]:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _depths(
    root: Node, parents: dict[Node, tuple[list[Node], set[int]]], input_path: set[Node]
) -> dict[Node, int]:
    """Longest distance from `root` of each input-path node (its parents all are on it)."""
    waiting = {n: len(parents[n][0]) for n in input_path}  # edges from parents not seen yet
    depth, ready = {root: 0}, [root]
    while ready:
        node = ready.pop()
        for child, _ in node.next_functions:
            if child in waiting:
                depth[child] = max(depth.get(child, 0), depth[node] + 1)
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
    return depth


def _weight_groups(
    params: Sequence[torch.Tensor],
    parents: dict[Node, tuple[list[Node], set[int]]],
    input_path: set[Node],
) -> list[_Group]:
    """Per weight, the input-path nodes its gradient leaves from; merged where shared."""
    # The weights' accumulators, from the graph itself (get_gradient_edge per weight costs
    # more than this whole walk).
    leaves: dict[int, Node] = {}
    for n in parents:
        if not n.next_functions and (v := getattr(n, "variable", None)) is not None:
            leaves[id(v)] = n
    group_of: dict[Node, _Group] = {}
    for p in params:
        node = leaves.get(id(p))
        if node is None:
            continue  # not used by this micro-batch: no gradient, as in a plain backward
        consumers: dict[Node, None] = {}
        seen, stack = {node}, [node]
        while stack:  # up from the weight through the nodes off the input path
            for parent in parents[stack.pop()][0]:
                if parent in input_path:
                    consumers[parent] = None
                elif parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        group = _Group(list(consumers), [p])
        for old in {id(group_of[c]): group_of[c] for c in consumers if c in group_of}.values():
            group.consumers += [c for c in old.consumers if c not in consumers]
            group.params = old.params + group.params
        for c in group.consumers:
            group_of[c] = group
    return list({id(g): g for g in group_of.values()}.values())
