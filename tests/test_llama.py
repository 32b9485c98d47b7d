"""The Llama-family model: its pieces against their definitions, every preset's parameter
count against the built module and the published checkpoints, and every strategy through
the training loop against single-process training (as tests/test_composition.py does for
the GPT)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import ModelConfig
from paratrain.models.llama import Llama, LlamaConfig, rotary
from paratrain.models.presets import MODEL_PRESETS, PUBLISHED_PARAMS, param_count, preset
from paratrain.models.registry import plain_model
from paratrain.plan.model import model_preset
from paratrain.validate import resolve_and_check
from tests.equivalence import check_layouts, tiny_config

SMALL = LlamaConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48)


def test_rotary_scores_depend_only_on_the_distance_between_positions():
    torch.manual_seed(0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    seq = 12
    q_rot = rotary(q.expand(1, 1, seq, 8), 10000.0)[0, 0]  # (T, hd): q at every position
    k_rot = rotary(k.expand(1, 1, seq, 8), 10000.0)[0, 0]
    scores = q_rot @ k_rot.T  # (T, T): q at m against k at n
    for shift in range(1, 4):
        assert torch.allclose(scores[shift:, shift:], scores[:-shift, :-shift], atol=1e-12)
    assert not torch.allclose(scores[0, 1], scores[0, 2])  # but on the distance it does
    assert torch.allclose(rotary(q.expand(1, 1, 1, 8), 10000.0)[0, 0, 0], q)  # position 0


def test_grouped_query_attention_equals_multi_head_with_shared_key_value_heads():
    torch.manual_seed(0)
    gqa = Llama(SMALL).double()
    mha = Llama(dataclasses.replace(SMALL, n_kv_head=SMALL.n_head)).double()
    state = gqa.state_dict()
    group, hd = SMALL.n_head // SMALL.n_kv_head, SMALL.d_model // SMALL.n_head
    for name, value in list(state.items()):
        if name.endswith(("attn.k.weight", "attn.v.weight")):  # (kv * hd, d) -> (h * hd, d)
            heads = value.view(SMALL.n_kv_head, hd, -1)
            state[name] = heads.repeat_interleave(group, dim=0).reshape(-1, value.shape[-1])
    mha.load_state_dict(state)
    ids = torch.randint(0, SMALL.vocab_size, (2, 10))
    assert torch.allclose(gqa(ids), mha(ids), atol=1e-12, rtol=0)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Llama(SMALL).double()
    ids = torch.randint(0, SMALL.vocab_size, (1, 10))
    changed = ids.clone()
    changed[0, 6:] = (ids[0, 6:] + 1) % SMALL.vocab_size
    assert torch.allclose(model(ids)[0, :6], model(changed)[0, :6], atol=1e-12)
    assert not torch.allclose(model(ids)[0, 6:], model(changed)[0, 6:])


def test_tied_embeddings_are_one_parameter():
    model = Llama(dataclasses.replace(SMALL, tie_embeddings=True))
    assert model.head.weight is model.tok_emb.weight
    untied = Llama(SMALL)
    n = SMALL.vocab_size * SMALL.d_model
    assert sum(p.numel() for p in untied.parameters()) - n == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_every_preset_counts_as_built_and_as_published(name):
    m = dataclasses.replace(ModelConfig(), **preset(name), name=name)
    with torch.device("meta"):  # the 70B model too: no memory
        built = sum(p.numel() for p in plain_model(m).parameters())
    assert param_count(m) == built
    assert model_preset(name).params == built  # `paratrain plan --preset NAME` counts the same
    if name in PUBLISHED_PARAMS:
        assert built == PUBLISHED_PARAMS[name]


# (world, dp, pp, tp, zero, sequence_parallel)
LAYOUTS = {
    2: [(2, 1, 1, 0, False), (2, 1, 1, 3, False), (1, 1, 2, 0, True), (1, 2, 1, 0, False)],
    8: [(2, 2, 2, 0, False)],
}
CLIP = 0.5  # below the norms of these runs (about 1 to 3): clipping is active


def llama_config(world, dp, pp, tp, zero, sp, tie=False):
    cfg = tiny_config(micro_batch=2, grad_clip=CLIP)
    fields = {**preset("llama-tiny"), "n_layer": 4, "d_model": 32, "ffn_hidden": 48}
    cfg.model = dataclasses.replace(cfg.model, **fields, name="llama-tiny", tie_embeddings=tie)
    p = cfg.parallel
    p.nproc, p.dp, p.pp, p.tp, p.zero, p.sequence_parallel = world, dp, pp, tp, zero, sp
    cfg.train.microbatches = 0
    return resolve_and_check(cfg, world)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_llama_layouts_match_single_process(world):
    """DP, ZeRO-3, TP with sequence parallelism (GQA: one key/value head per rank), PP 1F1B,
    and dp 2 x pp 2 x tp 2."""
    check_layouts(world, [llama_config(world, *layout) for layout in LAYOUTS[world]], CLIP)


def test_a_tied_llama_pipeline_matches_single_process():
    check_layouts(2, [llama_config(2, 1, 2, 1, 0, False, tie=True)], CLIP)


def test_key_value_heads_that_tp_does_not_divide_are_refused():
    with pytest.raises(ValueError, match="tp=4 must divide: 2 key/value heads"):
        llama_config(4, 1, 1, 4, 0, False)
