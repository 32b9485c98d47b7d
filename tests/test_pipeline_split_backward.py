"""ZB-H1's backward split in two (split_backward.py): the same gradients, each op once.

Exact here: BI + BW give the gradients of one plain backward bit for bit, since every
gradient comes from the same kernel on the same operands (only which outputs a node computes
changes between the passes). Counted where it happens: hooks on the autograd nodes say
which node ran in which pass, and a dispatch mode counts the aten ops the passes ran; BW
before the split walked the whole input path again and fails both.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from paratrain.data.tokens import BatchSampler
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.pipeline import PipelineRuntime, build_schedule, split_into_stages
from paratrain.parallel.pipeline.split_backward import backward_input
from paratrain.train.build import pipeline_plan
from tests.distributed import run_distributed
from tests.equivalence import tiny_data
from tests.test_pipeline_equivalence import build_stage, pipeline_config

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul"}
CONSUMERS = {"AddmmBackward0", "MmBackward0", "NativeLayerNormBackward0"}  # Linear, LayerNorm


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name (`mm`, `gelu_backward`, ...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def chunk_of_gpt(stage: int) -> nn.Module:
    """Stage 1 of 2 (two blocks, the head and the loss) or a middle piece (blocks only)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_head=2, d_model=16, max_seq_len=16))
    return split_into_stages(model, stage, 3, plan=pipeline_plan(GPT_PLAN))[0]


def forward(chunk: nn.Module, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(2, 8, 16, requires_grad=True)  # (b, T, C) from the previous stage
    targets = torch.randint(0, 256, (2, 8))
    return x, (chunk(x, targets) if last else chunk(x))


def all_nodes(root) -> list:
    seen, stack = {root}, [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return list(seen)


def output_grad(y: torch.Tensor, last: bool) -> torch.Tensor | None:
    return None if last else torch.randn(y.shape, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("stage", [1, 2])
def test_split_backward_equals_plain_backward_bit_for_bit(stage):
    chunk, last = chunk_of_gpt(stage), stage == 2
    x, y = forward(chunk, last)
    y.backward(output_grad(y, last))
    expected = (x.grad, {n: p.grad for n, p in chunk.named_parameters()})
    chunk.zero_grad(set_to_none=True)
    x, y = forward(chunk, last)
    gx, weight_grad = backward_input(y, output_grad(y, last), x, list(chunk.parameters()))
    assert all(p.grad is None for p in chunk.parameters())  # BI leaves the weights alone
    weight_grad.run()
    assert torch.equal(gx, expected[0])
    for n, p in chunk.named_parameters():
        assert torch.equal(p.grad, expected[1][n]), n


@pytest.mark.parametrize("stage", [1, 2])
def test_each_node_and_matmul_runs_once_per_micro_batch(stage):
    """Plain backward: every node once. Split: every node in one pass only, except the
    weight consumers (Linear, LayerNorm), once per pass; and the same matmuls in total."""
    chunk, last = chunk_of_gpt(stage), stage == 2
    x, y = forward(chunk, last)
    plain_ops = OpCounter()
    with plain_ops:
        y.backward(output_grad(y, last))

    x, y = forward(chunk, last)
    runs: dict[object, list[str]] = {node: [] for node in all_nodes(y.grad_fn)}
    phase = ["BI"]
    for node in runs:
        node.register_hook(lambda *_, node=node: runs[node].append(phase[0]))
    split_ops = OpCounter()
    with split_ops:
        gx, weight_grad = backward_input(y, output_grad(y, last), x, list(chunk.parameters()))
        phase[0] = "BW"
        weight_grad.run()

    twice = {node.name() for node, passes in runs.items() if len(passes) > 1}
    assert twice <= CONSUMERS, f"nodes run again in BW: {sorted(twice - CONSUMERS)}"
    for node, passes in runs.items():
        if node.name() in CONSUMERS and passes:
            assert passes == ["BI", "BW"], (node.name(), passes)
        elif not node.name().startswith("torch::autograd::AccumulateGrad"):
            assert len(passes) == 1, (node.name(), passes)
    layers = sum(isinstance(m, (nn.Linear, nn.LayerNorm)) for m in chunk.modules())
    assert sum(len(p) == 2 for p in runs.values()) == layers  # each consumer split once
    for op in MATMULS | {"gelu_backward", "_log_softmax_backward_data"}:
        assert split_ops.ops[op] == plain_ops.ops[op], (op, split_ops.ops, plain_ops.ops)
    assert plain_ops.ops["mm"] + plain_ops.ops["bmm"] > 0  # the counter saw the backward


def test_weight_used_twice_and_unused_weight():
    """The exception in split_backward.py: one Linear applied twice in a chunk. Its group's
    call walks the path between the two uses, but counts each kept gradient once."""
    torch.manual_seed(0)
    lin, unused = nn.Linear(8, 8), nn.Linear(8, 8)
    params = [*lin.parameters(), *unused.parameters()]

    def run(split: bool) -> tuple[torch.Tensor, list]:
        for p in params:
            p.grad = None
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = lin(torch.tanh(lin(x))).sum()
        if not split:
            y.backward()
            return x.grad, [p.grad for p in params]
        gx, weight_grad = backward_input(y, None, x, params)
        weight_grad.run()
        return gx, [p.grad for p in params]

    (gx_ref, ref), (gx, got) = run(split=False), run(split=True)
    assert torch.equal(gx, gx_ref)
    assert got[2:] == [None, None]  # no gradient where a plain backward gives none
    for g, r in zip(got[:2], ref[:2], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_a_checkpointed_block_is_recomputed_once_per_pass():
    """Recomputation (use_reentrant=False, as parallel/recompute.py) runs the block's
    forward again when backward first needs it: once in BI, and once for all of BW's
    calls, not once per call."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    forwards = []
    block.register_forward_pre_hook(lambda *_: forwards.append(1))  # early stop: no post-hook
    x = torch.randn(3, 8, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False).sum()
    gx, weight_grad = backward_input(y, None, x, list(block.parameters()))
    assert len(forwards) == 2  # the forward and BI's recomputation
    weight_grad.run()
    assert len(forwards) == 3
    got = [p.grad for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    x_ref = x.detach().requires_grad_()
    block(x_ref).sum().backward()
    assert torch.equal(gx, x_ref.grad)
    assert all(torch.equal(g, p.grad) for g, p in zip(got, block.parameters(), strict=True))


def count_step_matmuls(rank, world_size, cfg, data, names):
    """Per schedule, the matmuls one run_step runs on this stage (forwards and backwards)."""
    mesh = Mesh.build(pp=world_size)
    t = cfg.train
    k = t.global_batch // t.micro_batch
    micro = list(
        BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
        .global_batch_at(0)
        .split(t.micro_batch)
    )
    out = {}
    for name in names:
        chunks = build_stage(cfg, mesh.group("pp").rank, world_size, 1)
        runtime = PipelineRuntime(
            chunks, build_schedule(name, world_size, k, 1), mesh.group("pp"), cfg.model.d_model
        )
        counter = OpCounter()
        with counter:
            runtime.run_step(micro)
        out[name] = {op: counter.ops[op] for op in MATMULS}
    mesh.close()
    return out


def test_zb_h1_step_runs_the_matmuls_of_1f1b():
    """In the runtime, K = 4 on S = 2: ZB-H1's BI + BW do the work of 1F1B's B, per stage."""
    cfg = pipeline_config(2, 4, 1)
    results = run_distributed(count_step_matmuls, 2, cfg, tiny_data(), ["1f1b", "zb-h1"])
    for stage, counts in enumerate(results):
        assert counts["zb-h1"] == counts["1f1b"], (stage, counts)
        assert sum(counts["1f1b"].values()) > 0, stage
