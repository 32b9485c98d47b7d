"""The planner's Llama counts against the real model (models/llama.py), measured.

Activations: what autograd saves for backward, summed over unique storages with the
parameters left out (measure/activations.py's meter; the tp cases use the same pack hook,
as tests/test_tensor_parallel_model.py does for the GPT), float32 on CPU, against
activations.llama_layer_activation_bytes with device="cpu", at element size 4, and 2 for
bfloat16. Tolerance 0: every byte is explained. The formula counts torch's fused rms_norm
(`_fused_rms_norm`, which CUDA runs and which saves input and rms); on the CPU rms_norm is
the composite x * rsqrt(mean(x^2) + eps) * w in fp32 (ATen layer_norm.cpp,
rms_norm_composite), which keeps the fp32 input and the fp32 normalised input, (8 - e) h
bytes per token more than the fused kernel (the planner's `cpu_norm_extra`).

FLOPs: torch's FlopCounterMode over the model's forward and backward, attention run by
SDPA's math backend so that its products are matmuls the counter sees (the fused CPU
kernel is not counted), against time.llama_flops_per_token. Exact.

Breaking a formula is caught (tried once each, then restored): counting k and v at
n_kv_head width (what SDPA's enable_gqa would save, not what our attention saves) fails
every GQA case (llama-tiny by 65,536 of 1,412,096 bytes; the multi-head one passes, as it
should); three SwiGLU tensors instead of four fails every case; recomputing the down
projection too fails the recomputation's FLOPs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from paratrain.measure.activations import ActivationMeter
from paratrain.mesh import Mesh
from paratrain.models.gpt import Block, GPTConfig
from paratrain.models.llama import Llama, LlamaBlock, LlamaConfig
from paratrain.models.plans import LLAMA_TP_PLAN
from paratrain.models.presets import preset
from paratrain.parallel.recompute import apply_recomputation
from paratrain.parallel.tensor_parallel import apply_tensor_parallel
from paratrain.plan import activations
from paratrain.plan import time as ptime
from paratrain.plan.cluster import cluster_preset
from paratrain.plan.estimate import estimate
from paratrain.plan.layout import PRECISIONS, Layout, Workload
from paratrain.plan.model import ModelSpec, model_preset
from tests.distributed import run_distributed

FP32 = 4  # bytes of one float32 element
TINY = LlamaConfig(**{k: v for k, v in preset("llama-tiny").items() if k != "arch"})
CONFIGS = {  # llama-tiny (2 query heads per key/value head), and the two ends of GQA
    "llama-tiny": TINY,
    "mha": dataclasses.replace(TINY, n_kv_head=4, ffn_hidden=256),
    "mqa": dataclasses.replace(TINY, n_kv_head=1, ffn_hidden=200, d_model=96, n_head=3),
}


def spec(cfg: LlamaConfig, seq_len: int) -> ModelSpec:
    """The planner's view of a Llama config at this sequence length."""
    fields = ("n_layer", "d_model", "n_head", "vocab_size", "n_kv_head", "ffn_hidden")
    return ModelSpec("test", seq_len=seq_len, arch="llama", **{f: getattr(cfg, f) for f in fields})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_llama_block_saves_what_the_formula_counts(name, dtype):
    cfg, s, b = CONFIGS[name], 64, 2
    torch.manual_seed(0)
    block = LlamaBlock(cfg).to(dtype)
    x = torch.randn(b, s, cfg.d_model, dtype=dtype, requires_grad=True)  # the embedding's
    with ActivationMeter(block) as meter:
        block(x)
    e = dtype.itemsize
    formula = activations.llama_layer_activation_bytes(
        spec(cfg, s), b, 1, "none", element_bytes=e, device="cpu"
    )
    assert meter.total == formula
    # The CPU's norms keep (8 - e) h per token more than CUDA's fused kernel, two a block.
    fused = activations.llama_layer_activation_bytes(spec(cfg, s), b, 1, "none", element_bytes=e)
    assert formula - fused == 2 * (8 - e) * b * s * cfg.d_model


def _saved_bytes_per_block(rank, k, cfg, sp):
    """Activation bytes one block saves on this tp rank: 2 layers minus 1 layer."""
    group = Mesh.build(tp=k).group("tp")
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    saved = []
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = Llama(dataclasses.replace(cfg, n_layer=n_layer))
        apply_tensor_parallel(model, LLAMA_TP_PLAN, group, sequence_parallel=sp)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}  # one tensor saved by several ops is stored once

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids[:, :-1], ids[:, 1:])
        saved.append(sum(storages.values()))
    return saved[1] - saved[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_llama_block_under_tensor_parallelism_splits_what_the_formula_splits(sp):
    """tp = 2 splits heads and the SwiGLU width; sequence parallelism also the norms' inputs
    and rms, but not their outputs, which the column-parallel layers keep gathered."""
    k, s, b = 2, 64, 2
    measured = run_distributed(_saved_bytes_per_block, k, TINY, sp)
    formula = activations.llama_layer_activation_bytes(
        spec(TINY, s), b, k, "none", sp, FP32, device="cpu"
    )
    assert measured == [formula] * k


def test_llama_formula_recompute_modes_and_precision():
    m = model_preset("llama3-8b")
    s, h = m.seq_len, m.d_model
    none = activations.llama_layer_activation_bytes(m, 1, 8, "none")
    # Selective (parallel/recompute.py): s b [2 (h + 2h + (2h + 2 d_kv + 2f) / 8) + 4 a / 8]
    selective = activations.llama_layer_activation_bytes(m, 1, 8, "selective")
    assert selective == 8192 * (2 * (3 * 4096 + (2 * 4096 + 2 * 1024 + 2 * 14336) / 8) + 16)
    assert selective == 281_149_440
    assert activations.llama_layer_activation_bytes(m, 1, 8, "full") == 2 * s * h
    assert activations.llama_layer_activation_bytes(m, 1, 8, "full", True) == 2 * s * h / 8
    # s b [2 (2h + 2h + (4h + 4f) / 8) + 4 (2 + a / 8)] + 2 * 2 s d, h = 4096, f = 14336
    assert none == 8192 * (2 * (4 * 4096 + (4 * 4096 + 4 * 14336) / 8) + 4 * (2 + 32 / 8)) + (
        2 * 2 * 8192 * 128
    )
    assert none == 423_821_312
    # The planner charges it at the workload's element size, the fp32 statistics as they are.
    assert activations.block_activation_bytes(m, Workload(), 8) == none  # mixed: 16-bit
    fp32 = activations.block_activation_bytes(m, Workload(precision=PRECISIONS["fp32"]), 8)
    assert fp32 == 2 * none - 8192 * 4 * (2 + 32 / 8)


def test_llama_activation_bytes_in_the_estimate():
    m, lay = model_preset("llama3-8b"), Layout(tp=8)
    est = estimate(m, cluster_preset("h100-80gb-nvlink450-ib50"), Workload(), lay)
    logits = 4 * m.seq_len * m.vocab_size / 8  # fp32, vocabulary-split
    assert est.activation_bytes == 32 * 423_821_312 + logits
    # Korthikanti's GPT count at this shape would charge the s^2 scores: 4 times as much.
    gpt = dataclasses.replace(m, arch="gpt")
    assert activations.block_activation_bytes(gpt, Workload(), 8) > 4 * 423_821_312


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_llama_flops_per_token_count_the_models_matmuls(recompute):
    cfg, s, b = TINY, 64, 2
    torch.manual_seed(0)
    model = Llama(cfg)
    apply_recomputation(model.blocks, recompute)
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(ids[:, :-1], ids[:, 1:]).backward()
    formula = ptime.llama_flops_per_token(spec(cfg, s), recompute)
    assert counter.get_total_flops() == formula * b * s


def test_llama_flops_beside_6n_and_the_gpt_unchanged():
    m = model_preset("llama3-8b")
    per_token = ptime.llama_flops_per_token(m)
    # 6 (L P + V h) + 12 L s h: P = 2h^2 + 2h d_kv + 3hf = 218,103,808 for Llama 3 8B.
    assert per_token == 6 * (32 * 218_103_808 + 128256 * 4096) + 12 * 32 * 8192 * 4096
    assert per_token / (6 * m.params) == pytest.approx(1.202, abs=1e-3)  # attention at s = 8192
    assert ptime.model_training_flops(m, 10.0) == 10 * per_token
    gpt = model_preset("7b")
    assert ptime.model_training_flops(gpt, 10.0, "full") == 8 * 7e9 * 10  # 8 N T, as before


def test_gpt_block_measured_against_korthikanti_unchanged():
    """The validation's GPT ratio (docs/planner.md): per block 16.1 fp32 (b, T, C) tensors
    saved against Korthikanti's 27.0 at T = 128, b = 2, d = 128, 4 heads: LayerNorm inputs
    and outputs, q, k, v, the attention output (6), fc and gelu outputs (8); plus per token
    fp32 LayerNorm means and rstds (4) and a logsumexp per head."""
    s, b, h, a = 128, 2, 128, 4
    torch.manual_seed(0)
    block = Block(GPTConfig(n_head=a, d_model=h))
    x = torch.randn(b, s, h, requires_grad=True)
    with ActivationMeter(block) as meter:
        block(x)
    sbh = s * b * h * FP32
    assert meter.total == 16 * sbh + s * b * (4 + a) * FP32
    korthikanti = 2 * activations.layer_activation_bytes(s, b, h, a, 1, "none")  # fp32: twice
    assert (round(meter.total / sbh, 1), round(korthikanti / sbh, 1)) == (16.1, 27.0)
    assert meter.total / korthikanti == pytest.approx(0.595, abs=1e-3)


def test_the_planner_refuses_tp_that_splits_kv_heads_as_the_runtime_does():
    from paratrain.plan.estimate import shape_problems

    model = model_preset("llama3-8b")  # 32 heads, 8 key/value heads
    cluster = cluster_preset("seeds-80gb-nvlink300-ib50-1e14")
    assert shape_problems(model, cluster, Layout(dp=1, tp=8, pp=1)) == []
    problems = shape_problems(model, cluster, Layout(dp=1, tp=16, pp=1))
    assert "tp 16 does not divide 8 key/value heads" in problems
