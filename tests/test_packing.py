"""Packed documents (`--packing documents`, issue 34): whole documents side by side in a
row, each attending only to itself with its positions restarting. A packed row's logits
and gradients equal those of each document run alone (float64, 1e-10: the same sums in
other orders), every layout trains packed rows as one process does, and masked tokens get
no gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain.config import RunConfig
from paratrain.data.document_rows import PackedRows, pack, training_rows
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.llama import Llama, LlamaConfig
from paratrain.token_rows import (
    PAD,
    document_positions,
    model_keywords,
    split_rows,
    target_count,
)
from tests.distributed import run_distributed
from tests.equivalence import (
    References,
    assert_layout_equivalent,
    tiny_config,
    train_layouts,
)
from tests.test_supervised import sft_data

MODELS = [
    (GPT, GPTConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=64)),
    (Llama, LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64)),
]


def test_pack_keeps_every_document_whole_and_in_order():
    lengths = np.array([5, 9, 3, 20, 2, 2, 7], dtype=np.int64)
    bounds = pack(lengths, 12)
    assert bounds.tolist() == [0, 1, 3, 4, 7]  # 5 | 9+3 | 20 (cut) | 2+2+7
    data = sft_data()
    rows = PackedRows(data.train, data.documents["train"], 16, 4, seed=0)
    starts = [0, *np.cumsum(data.documents["train"]).tolist()]
    for r in range(rows.num_windows):
        row = rows.row(r)
        _, positions = split_rows(row[None]), document_positions(row[None])[0]
        first = int(rows.bounds[r])
        for d in range(first, int(rows.bounds[r + 1])):  # each document's ids, its mask
            at = starts[d] - starts[first] if d > first else 0
            doc = data.train[starts[d] : starts[d + 1]][: 17 - at]
            assert torch.equal(row[at + 1 : at + len(doc)], doc[1:])  # mask kept
            assert row[at] < 0 and (at == 16 or positions[at] == 0)  # no target; restart
        assert (row[at + len(doc) :] == PAD).all()


def _packed(vocab: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three documents of 7, 12 and 5 ids (a prompt of 3 masked each) in one row of 29."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in (7, 12, 5)]
    for d in docs:
        d[:3] = torch.bitwise_not(d[:3])
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    rows = PackedRows(torch.cat(docs), lengths, 28, 1, seed=0)
    assert rows.num_windows == 1
    return rows.row(0)[None], docs


@pytest.mark.parametrize("make, cfg", MODELS, ids=["gpt", "llama"])
def test_a_packed_row_equals_each_document_alone(make, cfg):
    torch.manual_seed(0)
    model = make(cfg).double()
    row, docs = _packed(cfg.vocab_size)
    logits = model(split_rows(row)[0], **model_keywords(row))[0]  # (T, V)
    model(*split_rows(row), **model_keywords(row)).mul(target_count(row)).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    at = 0
    for doc in docs:  # alone: positions from 0, plain causal attention
        alone = doc[None]
        inputs, targets = split_rows(alone)
        torch.testing.assert_close(
            logits[at : at + len(doc) - 1], model(inputs)[0], rtol=0, atol=1e-10
        )
        model(inputs, targets).mul(target_count(alone)).backward()  # sums accumulate
        at += len(doc)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=0, atol=1e-10, msg=name)


def test_a_packed_document_start_is_never_a_target_and_gets_no_gradient():
    torch.manual_seed(0)
    model = GPT(MODELS[0][1]).double()
    row, docs = _packed(256)
    out = []
    model.head.register_forward_hook(lambda m, i, o: o.retain_grad() or out.append(o))
    model(*split_rows(row), **model_keywords(row)).backward()
    grad = out[0].grad.abs().sum(-1)[0]  # (T,)
    targets = row[0, 1:] >= 0
    assert targets.sum() == sum(len(d) - 3 for d in docs)  # answers only
    assert grad[~targets].eq(0).all() and grad[targets].gt(0).all()


def packed_config(**parallel) -> RunConfig:
    """tiny_config's run at world 2 over packed rows of 32, resolved as `train` does."""
    from paratrain.validate import resolve_and_check

    cfg = tiny_config(steps=4, seq_len=31)
    cfg.data.packing, cfg.parallel.nproc = "documents", 2
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return resolve_and_check(cfg, 2)


LAYOUTS = [dict(dp=2), dict(dp=2, zero=3), dict(pp=2), dict(tp=2)]


def test_every_layout_trains_packed_rows_as_one_process():
    """Packed rows through DP, ZeRO-3, the pipeline and tensor parallelism (sequence
    parallel), against one plain process on the same rows, to the derived tolerance."""
    data = sft_data()
    batch = training_rows(data, "documents", 31, 8, 0).global_batch_at(0)
    assert (document_positions(batch) == 0).sum() > len(batch)  # rows of several documents
    configs = [packed_config(**layout) for layout in LAYOUTS]
    runs = [(c.parallel.dp, c.parallel.pp, c.parallel.tp, c) for c in configs]
    per_rank = run_distributed(train_layouts, 2, runs, data, timeout=600)
    references = References(data)
    for i, cfg in enumerate(configs):
        assert_layout_equivalent([r[i] for r in per_rank], cfg, data, None, references)


def test_packing_documents_is_refused_under_context_parallelism(capsys):
    argv = ["train", "--packing", "documents", "--cp", "2", "--nproc", "2", "--dry-run"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert "--packing documents with --cp 2" in line and "\n" not in line


def test_packed_attention_runs_the_fused_kernel():
    """The document mask goes to scaled_dot_product_attention's fused kernel (on the CPU,
    flash attention, forward and backward), not an unfused softmax of the scores."""
    from paratrain.models.kv_cache import attend

    row, _ = _packed(256)
    positions = document_positions(row)
    q = torch.randn(1, 2, positions.shape[1], 8, requires_grad=True)
    with torch.profiler.profile() as prof:
        attend(q, q, q, 0, positions=positions).sum().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops, ops
    assert "aten::_softmax" not in ops, ops
