"""Splitting a model into pipeline chunks: build full, then slice (one process, no comm)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.pipeline import PipelinePlan, split_into_stages, stage_layout
from paratrain.parallel.pipeline.stage import partition
from paratrain.train.build import pipeline_plan

GPT_SPLIT = pipeline_plan(GPT_PLAN)


def gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, d_model=16, max_seq_len=16))


@pytest.mark.parametrize("num_stages, chunks", [(1, 1), (2, 1), (4, 1), (2, 2), (3, 2)])
def test_chunks_in_virtual_order_compute_the_full_model_exactly(num_stages, chunks):
    model = gpt(6)
    ids = torch.randint(0, 256, (2, 8))
    targets = torch.randint(0, 256, (2, 8))
    per_stage = [
        split_into_stages(model, s, num_stages, chunks, plan=GPT_SPLIT) for s in range(num_stages)
    ]
    pieces = [per_stage[vs % num_stages][vs // num_stages] for vs in range(num_stages * chunks)]
    x = ids
    for piece in pieces[:-1]:
        x = piece(x)
    assert torch.equal(pieces[-1](x, targets), model(ids, targets))
    names = [n for piece in pieces for n, _ in piece.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once
    assert [p.tok_emb is not None for p in pieces] == [True] + [False] * (len(pieces) - 1)
    assert [p.head is not None for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_layout_is_contiguous_and_balanced_by_layers():
    layout = stage_layout(
        gpt(7), 2, 2, plan=GPT_SPLIT
    )  # 4 pieces of 7 blocks: 2 2 2 1, larger first
    assert layout == [["0", "1"], ["2", "3"], ["4", "5"], ["6"]]
    chunks = split_into_stages(
        gpt(7), 1, 2, 2, plan=GPT_SPLIT
    )  # stage 1 holds virtual stages 1 and 3
    assert [list(c.blocks.keys()) for c in chunks] == [["2", "3"], ["6"]]
    assert chunks[1].head is not None and chunks[0].head is None


def test_balance_by_parameters_counts_the_embeddings_and_head():
    """GPT's embedding (256 x C + 16 x C) and head (256 x C) are worth about a block
    each here, so with params balance the end stages get fewer blocks."""
    model = gpt(6)
    by_layers = stage_layout(model, 3, balance="layers", plan=GPT_SPLIT)
    by_params = stage_layout(model, 3, balance="params", plan=GPT_SPLIT)
    assert [len(p) for p in by_layers] == [2, 2, 2]
    assert len(by_params[1]) > len(by_params[0]) and len(by_params[1]) > len(by_params[2])


def test_partition_minimises_the_heaviest_piece():
    assert partition([5, 1, 1, 1, 1, 5], 3) == [range(0, 1), range(1, 5), range(5, 6)]
    assert partition([1, 1, 1, 1], 2, first_extra=2) == [range(0, 1), range(1, 4)]


class Tower(nn.Module):
    """A user's model: its own names, ends that may be None, blocks in a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.inp: nn.Linear | None = nn.Linear(3, 8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
        self.out: nn.Linear | None = nn.Linear(8, 1)

    def forward(self, x, targets=None):
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        if self.out is None:
            return x
        return ((self.out(x) - targets) ** 2).mean()


def test_a_user_model_splits_with_its_own_plan():
    torch.manual_seed(0)
    model = Tower()
    plan = PipelinePlan(blocks="layers", first=("inp",), last=("out",))
    first, second = (split_into_stages(model, s, 2, plan=plan)[0] for s in range(2))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    assert torch.equal(second(first(x), y), model(x, y))
    assert first.out is None and second.inp is None
    assert model.out is not None and len(model.layers) == 4  # the full model is untouched


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="4 blocks cannot be split into 6 pipeline pieces"):
        split_into_stages(gpt(4), 0, 3, 2, plan=GPT_SPLIT)
    with pytest.raises(ValueError, match="stage 2 outside 0..1"):
        split_into_stages(gpt(4), 2, 2, plan=GPT_SPLIT)
    with pytest.raises(ValueError, match="module 'out' has parameters but the plan places"):
        split_into_stages(Tower(), 0, 2, plan=PipelinePlan(blocks="layers", first=("inp",)))
    with pytest.raises(ValueError, match="balance 'flops'; valid: layers, params"):
        split_into_stages(gpt(4), 0, 2, balance="flops", plan=GPT_SPLIT)
