"""Activation recomputation: same losses and gradients, and only what each mode keeps held.

full keeps each block's input. selective (parallel/recompute.py) keeps the matmul and
fused-attention outputs; what one block's forward leaves held is measured two ways:
- by liveness: a dispatch mode takes a weak reference to the storage of every tensor an
  op returns; after the forward, those still alive (parameters, the input and the output
  left out; the input added once, since every mode saves it) are what the forward left
  held for backward, whoever holds them (autograd's saved tensors, the checkpoint's
  cache). No hook of ours is involved, so the policy cannot report itself.
- by the project's ActivationMeter (saved-tensor hooks), which the pipeline's in-flight
  bytes and `plan --validate` read; selective shows it what the checkpoint's cache holds.
Both equal plan/activations.py's selective formulas to the byte (float32 on CPU, GPT and three
Llama variants, tp 1 and 2, with and without sequence parallelism: tolerance 0), and the
liveness measure equals the meter and the known counts for none and full too. Breaking the
policy (tried once, patched in, then removed): keeping every op's output (`keeps` returning
True) fails every memory case (GPT at s 64, b 2: 593,920 bytes held against the formula's
362,496; llama-tiny 2,209,152 against 755,712), the FLOP test (the Llama's rms_norm adds
in place to a kept tensor, which torch refuses) and the pointwise one (nothing repeated).

Recompute cost: torch's FlopCounterMode, the CPU's fused attention counted with torch's
own SDPA formulas, finds selective's step exactly as many FLOPs as no recomputation (no
matmul or attention runs twice; plan/time.py), and full's extra exactly the planner's; the
pointwise work repeated is counted in output elements: 7h + 4 per token per GPT block.

Training with selective equals training without, in float32, through the training loop
(DP, ZeRO-3, TP with sequence parallelism, a ZB-H1 pipeline of the Llama, whose B and W
both go through each block), and the TP traffic equals full's, as plan/rank_traffic.py
counts it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from paratrain.config import RECOMPUTE_MODES
from paratrain.measure.activations import ActivationMeter
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, Block, GPTConfig
from paratrain.models.llama import Llama, LlamaBlock
from paratrain.models.plans import GPT_TP_PLAN, LLAMA_TP_PLAN
from paratrain.parallel.recompute import apply_recomputation
from paratrain.parallel.tensor_parallel import apply_tensor_parallel
from paratrain.plan import activations
from paratrain.plan import time as ptime
from paratrain.train.build import build_model
from paratrain.validate import resolve_and_check
from tests.distributed import run_distributed
from tests.equivalence import record_of, tiny_config, tiny_data
from tests.test_plan_llama import CONFIGS, TINY, spec

FP32 = 4
GPT_CFG = GPTConfig(n_layer=1, n_head=4, d_model=64)
aten = torch.ops.aten


def batch():
    return torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))


def measured(model):
    x = batch()
    regions = {f"block {i}": b for i, b in model.blocks.items()}
    with ActivationMeter(model, regions) as meter:
        loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, meter


def test_recomputation_keeps_losses_and_gradients_and_saves_only_block_inputs():
    cfg = tiny_config()
    plain = build_model(cfg)
    recomputed = copy.deepcopy(plain)
    assert apply_recomputation(recomputed.blocks) == cfg.model.n_layer
    loss_a, grads_a, meter_a = measured(plain)
    loss_b, grads_b, meter_b = measured(recomputed)
    assert loss_a == loss_b
    for name, g in grads_a.items():
        assert torch.allclose(g, grads_b[name], atol=1e-7), name
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    b, t, c = 4, 16, cfg.model.d_model
    block_input = b * t * c * 4  # float32
    for i in range(cfg.model.n_layer):
        # Without recomputation a block saves many tensors; with it only its input, which
        # is the previous block's output and is attributed to the block that made it.
        assert meter_a.by_region[f"block {i}"] > 8 * block_input
        assert meter_b.by_region.get(f"block {i}", 0) <= block_input
    assert meter_b.total < meter_a.total / 2


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="recompute mode 'half'; valid: none, selective, full"):
        apply_recomputation([], "half")


# --- selective: what one block leaves held, measured ------------------------------------


class Allocations(TorchDispatchMode):
    """A weak reference to the storage of every tensor the ops under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t.untyped_storage()))
        return out

    def alive(self, leave_out: set[int]) -> int:
        """Bytes of the distinct storages still alive, less those at the addresses in
        leave_out."""
        gc.collect()
        held = {s.data_ptr(): s.nbytes() for ref in self.made if (s := ref()) is not None}
        return sum(n for ptr, n in held.items() if ptr not in leave_out)


SETTLE_S = 5.0


def held_by_forward(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes the block's forward left held, by liveness; the meter's saved bytes).

    Held means alive until backward, not for a moment: gloo's worker thread lets go of a
    finished collective's buffers only after it has woken the caller (measure/allocator.py
    notes the same), so at tp 2 a buffer can outlive the forward by a little (seen about
    once in 100 forwards with two CPU-bound processes beside). The count is read again
    until it matches the meter's, for at most SETTLE_S seconds: a tensor really held for
    backward never lets go, and the assertions compare both counts with the formula.
    """
    with ActivationMeter(block) as meter, Allocations() as made:
        y = block(x)
    ptr = x.untyped_storage().data_ptr()
    assert ptr in meter.storages, "every mode saves the block's input"
    leave_out = meter.param_storages | {ptr, y.untyped_storage().data_ptr()}
    deadline = time.monotonic() + SETTLE_S
    held = made.alive(leave_out) + x.untyped_storage().nbytes()
    while held != meter.total and time.monotonic() < deadline:
        time.sleep(0.01)
        held = made.alive(leave_out) + x.untyped_storage().nbytes()
    return held, meter.total


def block_of(name: str) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(0)
    if name == "gpt":
        return Block(GPT_CFG), GPT_CFG.d_model
    return LlamaBlock(CONFIGS[name]), CONFIGS[name].d_model


def formula(name: str, mode: str, s: int, b: int, tp: int = 1, sp: bool = False) -> float:
    """plan/activations.py's count at float32, on the CPU's kernels."""
    if name == "gpt":
        c = GPT_CFG
        return activations.layer_activation_bytes(s, b, c.d_model, c.n_head, tp, mode, sp, FP32)
    cfg = spec(CONFIGS[name], s)
    return activations.llama_layer_activation_bytes(cfg, b, tp, mode, sp, FP32, device="cpu")


@pytest.mark.parametrize("name", ["gpt", *CONFIGS])
def test_one_block_holds_what_the_formula_counts_in_every_mode(name):
    s, b = 64, 2
    block, h = block_of(name)
    x = torch.randn(b, s, h, requires_grad=True)  # as the embedding's output
    held, metered = {}, {}
    for mode in RECOMPUTE_MODES:
        recomputed = copy.deepcopy(block)
        apply_recomputation([recomputed], mode)
        held[mode], metered[mode] = held_by_forward(recomputed, x)
    assert held["selective"] == formula(name, "selective", s, b)
    assert held["full"] == formula(name, "full", s, b)
    if name == "gpt":  # 16 (b, s, h) and per token the norms' statistics and a logsumexp
        assert held["none"] == (16 * s * b * h + s * b * (4 + GPT_CFG.n_head)) * FP32
    else:
        assert held["none"] == formula(name, "none", s, b)
    assert metered == held  # the meter sees what is held, in every mode
    assert held["selective"] < 0.75 * held["none"]


def _held_under_tensor_parallelism(rank, k, name, sp):
    """One selective block of a tp-split model, on this rank's input."""
    group = Mesh.build(tp=k).group("tp")
    torch.manual_seed(0)
    if name == "gpt":
        model, plan, h = GPT(GPT_CFG), GPT_TP_PLAN, GPT_CFG.d_model
    else:
        model, plan, h = Llama(dataclasses.replace(TINY, n_layer=1)), LLAMA_TP_PLAN, TINY.d_model
    apply_tensor_parallel(model, plan, group, sequence_parallel=sp)
    apply_recomputation(model.blocks, "selective")
    s, b = 64, 2
    x = torch.randn(b, s // k if sp else s, h, generator=torch.Generator().manual_seed(1))
    return held_by_forward(model.blocks["0"], x.requires_grad_())


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("name", ["gpt", "llama-tiny"])
def test_selective_block_under_tensor_parallelism(name, sp):
    """tp = 2: the column-parallel outputs and the attention split, the row-parallel partial
    sums whole; sequence parallelism splits only the block's input."""
    k = 2
    expected = formula(name, "selective", 64, 2, k, sp)
    # gloo's order: NCCL's (comm/ordering.py) runs each collective on a stream thread, out
    # of reach of the saved-tensor hooks and dispatch modes of the thread measured here.
    held = run_distributed(_held_under_tensor_parallelism, k, name, sp, order="gloo")
    assert held == [(expected,) * 2] * k


# --- selective: what it recomputes ------------------------------------------------------


def _cpu_flash(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _cpu_flash_backward(grad, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad, q, k, v)


# The CPU's fused attention, which FlopCounterMode leaves out, counted as its CUDA kernels.
CPU_FLASH = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def step_flops(model: torch.nn.Module, mode: str, ids: torch.Tensor) -> int:
    model = copy.deepcopy(model)
    apply_recomputation(model.blocks, mode)
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as counter:
        model(ids[:, :-1], ids[:, 1:]).backward()
    return counter.get_total_flops()


def test_selective_runs_no_matmul_twice_as_the_planner_counts():
    s, b = 64, 2
    ids = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    llama = Llama(TINY)
    flops = {mode: step_flops(llama, mode, ids) for mode in RECOMPUTE_MODES}
    for mode in ("selective", "full"):
        planned = ptime.llama_flops_per_token(spec(TINY, s), mode)
        planned -= ptime.llama_flops_per_token(spec(TINY, s), "none")
        assert flops[mode] - flops["none"] == planned * b * s, mode
    assert flops["selective"] == flops["none"]
    gpt = GPT(dataclasses.replace(GPT_CFG, n_layer=2))
    assert step_flops(gpt, "selective", ids) == step_flops(gpt, "none", ids)
    assert ptime.training_flops(10, 1.0, "selective") == ptime.training_flops(10, 1.0)


class Elements(TorchDispatchMode):
    """Output elements of the ops that compute (views and matmuls left out), by op."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        views = any(r.alias_info is not None for r in func._schema.returns)
        if not views and func not in (aten._unsafe_view.default, aten.mm.default):
            n = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + n
        return out


def test_selective_repeats_only_pointwise_work_in_backward():
    """Per token per GPT block: both LayerNorms (h and 2 statistics each), gelu (4h), and
    the residual add that feeds the second LayerNorm: 7h + 4 elements."""
    s, b = 64, 2
    block, h = block_of("gpt")
    by_mode = {}
    for mode in ("none", "selective"):
        recomputed = copy.deepcopy(block)
        apply_recomputation([recomputed], mode)
        y = recomputed(torch.randn(b, s, h, requires_grad=True))
        with Elements() as counted:
            y.sum().backward()
        by_mode[mode] = counted.by_op
    more = {op: n - by_mode["none"].get(op, 0) for op, n in by_mode["selective"].items()}
    more = {op: n // (b * s) for op, n in more.items() if n}
    assert more == {
        "native_layer_norm.default": 2 * (h + 2),
        "gelu.default": 4 * h,
        "add.Tensor": h,
    }


# --- selective: training equals training without ----------------------------------------

# Measured: identical losses, norms and parameters (the same ops on the same numbers);
# the brief's bound is kept as the assertion.
RTOL = ATOL = 1e-6


LAYOUTS = {  # name: parallel settings at world 2
    "dp": {"dp": 2},
    "zero3": {"dp": 2, "zero": 3},  # FSDP gathers each block's parameters again in backward
    "tp+sp": {"tp": 2, "sequence_parallel": True},
    "zb-h1": {"pp": 2, "schedule": "zb-h1"},  # of the Llama: B and W both recompute
}
LLAMA = {"arch": "llama", "name": "llama-tiny", "n_head": 4, "n_kv_head": 2, "ffn_hidden": 48}


def selective_layouts() -> list:
    """((name, mode), config) at world 2: each layout without recomputation and with
    selective; TP also with full, for its traffic."""
    runs = []
    for name, settings in LAYOUTS.items():
        for mode in ("none", "selective", "full") if name == "tp+sp" else ("none", "selective"):
            cfg = tiny_config(micro_batch=1, grad_clip=0.5, recompute=mode)
            cfg.model.n_layer = 4
            if name == "zb-h1":
                cfg.model = dataclasses.replace(cfg.model, **LLAMA)
            cfg.parallel = dataclasses.replace(cfg.parallel, nproc=2, **settings)
            cfg.train.microbatches = 0
            runs.append(((name, mode), resolve_and_check(cfg, 2)))
    return runs


def _train(rank, world, runs, data):
    """Each run's record, and the planner's bytes per step beside the ledger's (the
    summary `paratrain train` prints: train/prediction.py)."""
    from tests.test_prediction import train_tracked

    out = []
    for _, cfg in runs:
        result, compared, mesh = train_tracked(cfg, data)
        sent = (
            compared["predicted"]["bytes_sent_per_step"],
            compared["measured"]["bytes_sent_per_step"],
        )
        out.append((record_of(result, mesh.group("tp")), sent))
        mesh.close()
    return out


def test_training_with_selective_recomputation_equals_training_without():
    runs = selective_layouts()
    per_rank = run_distributed(_train, 2, runs, tiny_data(), timeout=600)
    results = {key: [r[i] for r in per_rank] for i, (key, _) in enumerate(runs)}
    for name in LAYOUTS:
        ranks = zip(results[name, "none"], results[name, "selective"], strict=True)
        for (plain, _), (selective, _) in ranks:
            for a, b in zip(selective.losses, plain.losses, strict=True):
                assert math.isclose(a, b, rel_tol=RTOL), name
            for a, b in zip(selective.grad_norms, plain.grad_norms, strict=True):
                assert math.isclose(a, b, rel_tol=RTOL), name
            assert selective.state.keys() == plain.state.keys()
            for key, value in plain.state.items():
                assert torch.allclose(selective.state[key], value, rtol=0, atol=ATOL), key
    # Every rank sends what plan/rank_traffic.py predicts; selective recomputes the
    # collectives that full recomputes, no more and no fewer.
    for key, ranks in results.items():
        for _, (predicted, measured) in ranks:
            assert predicted == measured, key
    sent = {mode: results["tp+sp", mode][0][1][1] for mode in RECOMPUTE_MODES}
    assert sent["selective"] == sent["full"] != sent["none"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_block_is_freed_as_soon_as_nothing_holds_it(mode):
    """A pipeline split drops the other stages' blocks; a recomputed block whose forward
    held it strongly was a reference cycle, freed only by the cyclic collector: its
    parameters stayed alive (simulate's memory meter found llama3-70b over pp 8 keeping
    the whole model on every rank). With the collector off, the block goes with its last
    reference, and its forward still runs while it lives."""
    block, h = block_of("llama-tiny")
    apply_recomputation([block], mode)
    block(torch.randn(1, 8, h, requires_grad=True)).sum().backward()  # it runs
    gone = weakref.ref(block)
    gc.disable()
    try:
        del block
        assert gone() is None
    finally:
        gc.enable()
