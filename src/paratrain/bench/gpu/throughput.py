"""`python -m paratrain.bench.gpu.throughput`: one device's training throughput through our
engine and `train_step`, its model FLOPs utilisation, and its model-state bytes.

The model is a GPT of about 1.0e9 parameters (16 layers, d_model 2048, 16 heads, vocabulary
50304, sequences of 2048) in the run's default on CUDA: bf16 compute copies, an fp32 master
copy and fused AdamW. Model state is 16 bytes per parameter (16 GB); activations are about
34·T·d bytes per layer and sequence (Korthikanti et al., arXiv:2205.05198) plus the logits,
about 2.7 GB per sequence, since SDPA's fused attention keeps no T x T scores (the planner's
estimate counts them, and says 8 GB). So micro-batch 8, one per step, fits an 80 GB GPU; on
a smaller one, a step that runs out of memory is retried at half the micro-batch.
The world is one rank (a one-rank mesh: no communication). The tokens are random: the time
of a step does not depend on what they say.

Model FLOPs per token, as in PaLM's appendix B (arXiv:2204.02311): 6N + 12·L·d·T. 6N is the
matrix products over every weight, forward (2N) and backward (4N); N counts the parameters
that take part in one, so not the token and position embeddings, which are lookups (the
output head is a product and counts). 12·L·d·T is attention's QK^T and AV, forward and
backward, the causal mask not discounted. MFU = tokens/s x FLOPs per token / the GPU's
datasheet dense bf16 peak (`PEAK_BF16`); recomputation would add hardware FLOPs, not model
FLOPs. A GPU not in the table, or a CPU, gets no MFU.

Model-state bytes three ways: ours (`engine.memory_report`, what the replica and the
optimizer hold), the planner's (`predict(cfg)`), and the allocator's high-water mark
(`torch.cuda.max_memory_allocated`), which adds activations, logits and workspace.

`--device cpu --tiny` runs the same path on a 2-layer model in seconds (the tests use it).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from typing import Any

import torch

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.train.build import build_engine, run_gpt_config
from paratrain.train.prediction import predict
from paratrain.train.step import train_step
from paratrain.validate import resolve_and_check

# Datasheet dense (no sparsity) bf16 FLOP/s, by the words of the device's name; the first
# row whose words all appear wins, so the specific rows (PCIe, NVL) come first.
PEAK_BF16: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H200", "NVL"), 835e12),
    (("H100",), 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (("H200",), 989e12),
    (("GH200",), 989e12),
    (("A100",), 312e12),  # SXM and PCIe alike
    (("L40S",), 362e12),
    (("L4",), 121e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of a GPU named `device_name`; None if unknown."""
    words = {w.lower() for w in re.split(r"[^A-Za-z0-9]+", device_name) if w}
    for key, peak in PEAK_BF16:
        if all(k.lower() in words for k in key):
            return peak
    return None


def model_flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """PaLM's 6N + 12·L·d·T (see the module docstring)."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matrix product: all but the embedding tables."""
    lookups = {"tok_emb.weight", "pos_emb.weight"}
    return sum(p.numel() for n, p in model.named_parameters() if n not in lookups)


def throughput_config(device: str, tiny: bool = False, micro_batch: int = 0) -> RunConfig:
    """The ~1B GPT (or a 2-layer one) on one rank of `device`, resolved (dtype: auto)."""
    cfg = RunConfig()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if tiny:
        m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len = 256, 2, 2, 64, 64
        t.seq_len, t.micro_batch = 64, 4
    else:
        m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len = 50304, 16, 16, 2048, 2048
        t.seq_len, t.micro_batch = 2048, 8
    t.micro_batch = micro_batch or t.micro_batch
    t.global_batch, t.microbatches, t.lr = t.micro_batch, 0, 1e-4
    p.nproc, p.dp, p.device = 1, 0, device
    return resolve_and_check(cfg, 1)


def measure(cfg: RunConfig, steps: int = 20, warmup: int = 3) -> dict[str, Any]:
    """`warmup` untimed steps, then `steps` timed ones; the numbers of the module docstring."""
    m, t = cfg.model, cfg.train
    device = torch.device(cfg.parallel.device)
    mesh = Mesh.build(dp=1, device=device)
    torch.manual_seed(t.seed)
    with torch.device(device):  # drawn where it computes: a 1B model is slow to init on a CPU
        model = GPT(run_gpt_config(cfg))
    n_matmul = matmul_params(model)
    n_params = sum(p.numel() for p in model.parameters())
    engine = build_engine(cfg, mesh, model=model)
    optimizer = engine.build_optimizer(t.lr, t.weight_decay, (t.beta1, t.beta2))
    g = torch.Generator().manual_seed(t.seed)
    shape = (t.micro_batch, t.seq_len + 1)
    batches = [torch.randint(m.vocab_size, shape, generator=g) for _ in range(t.microbatches)]
    batches = [b.to(device) for b in batches]
    losses = [train_step(engine, optimizer, batches, t.lr, t.grad_clip).loss for _ in range(warmup)]
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(train_step(engine, optimizer, batches, t.lr, t.grad_clip).loss)
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    tokens_per_step = t.microbatches * t.micro_batch * t.seq_len
    flops = model_flops_per_token(n_matmul, m.n_layer, m.d_model, t.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_bf16_flops(name) if device.type == "cuda" and t.dtype == "bfloat16" else None
    tokens_per_s = tokens_per_step / step_s
    ours = engine.memory_report(optimizer)
    prediction = predict(cfg)
    return {
        "device": name,
        "torch": torch.__version__,
        "dtype": t.dtype,
        "params": n_params,
        "matmul_params": n_matmul,
        "n_layer": m.n_layer,
        "d_model": m.d_model,
        "n_head": m.n_head,
        "vocab_size": m.vocab_size,
        "seq_len": t.seq_len,
        "micro_batch": t.micro_batch,
        "microbatches": t.microbatches,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "achieved_flops": tokens_per_s * flops,
        "peak_flops": peak,
        "mfu": tokens_per_s * flops / peak if peak else None,
        "model_state_bytes": {**ours, "total": sum(ours.values())},
        "predicted_model_state_bytes": prediction.model_state[0],
        "predicted_activation_bytes": prediction.activation_bytes[0],
        "cuda_max_allocated_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
        "losses": [losses[0], losses[-1]],
    }


def _sync(device: torch.device) -> None:
    """Wait for the queued kernels, so the timer reads work done, not work launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report(r: dict[str, Any]) -> list[str]:
    """The human-readable block."""
    lines = [
        f"throughput on {r['device']}, torch {r['torch']}, {r['dtype']}, one rank",
        f"model: GPT {r['params']:.4g} parameters ({r['matmul_params']:.4g} in matmuls),"
        f" {r['n_layer']} layers, d_model {r['d_model']}, {r['n_head']} heads, "
        f"vocab {r['vocab_size']}, seq {r['seq_len']}, micro-batch {r['micro_batch']} x "
        f"{r['microbatches']} per step",
        f"{r['warmup_steps']} warm-up + {r['timed_steps']} timed steps: {r['step_s']:.4f} s/step, "
        f"{r['tokens_per_s']:,.0f} tokens/s; loss {r['losses'][0]:.3f} -> {r['losses'][1]:.3f}",
        f"model FLOPs/token 6N + 12·L·d·T = {r['flops_per_token']:.4g}: "
        f"{r['achieved_flops'] / 1e12:.4g} TFLOP/s achieved",
    ]
    if r["peak_flops"]:
        lines.append(
            f"MFU {100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e12:.0f} TFLOP/s "
            f"(datasheet dense bf16 of {r['device']})"
        )
    elif r["device"] == "CPU":
        lines.append("MFU: none on a CPU (no datasheet peak)")
    else:
        lines.append(f"MFU: unknown (no datasheet bf16 peak for {r['device']!r} in PEAK_BF16)")
    ours, planned = r["model_state_bytes"], r["predicted_model_state_bytes"]
    unit, size = ("GB", 1e9) if ours["total"] >= 1e9 else ("MB", 1e6)
    lines.append(f"model state, {unit}:   " + "  ".join(f"{k:>9}" for k in ours))
    lines.append("  ours (engine)    " + "  ".join(f"{v / size:9.3f}" for v in ours.values()))
    lines.append(
        "  planner          " + "  ".join(f"{planned.get(k, 0) / size:9.3f}" for k in ours)
    )
    held = r["cuda_max_allocated_bytes"]
    if held is None:
        lines.append("allocator: none on a CPU (no max_memory_allocated)")
        return lines
    act = r["predicted_activation_bytes"]
    estimate = f" (planner's activation estimate {act / size:.2f} {unit})" if act else ""
    lines.append(
        f"allocator peak (max_memory_allocated) {held / size:.2f} {unit} = model state "
        f"{ours['total'] / size:.2f} + activations and workspace "
        f"{(held - ours['total']) / size:.2f}{estimate}"
    )
    return lines


def measure_fitting(
    device: str, tiny: bool, micro_batch: int, steps: int, warmup: int
) -> tuple[dict[str, Any], list[str]]:
    """`measure`, at half the micro-batch after each out-of-memory error; and what was
    retried, for the report."""
    notes: list[str] = []
    while True:
        cfg = throughput_config(device, tiny, micro_batch)
        try:
            return measure(cfg, steps, warmup), notes
        except torch.cuda.OutOfMemoryError:
            if cfg.train.micro_batch == 1:
                raise
        # Out of the handler: its traceback no longer holds the failed attempt's tensors.
        micro_batch = cfg.train.micro_batch // 2
        notes.append(
            f"out of memory at micro-batch {cfg.train.micro_batch}: retried at {micro_batch}"
        )
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (seconds on CPU)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=0, help="default 8 (tiny: 4)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps {args.steps} --warmup {args.warmup}: each at least 1")
    try:
        throughput_config(args.device, args.tiny, args.micro_batch)  # checks the flags
    except ValueError as e:
        parser.error(str(e))
    result, notes = measure_fitting(
        args.device, args.tiny, args.micro_batch, args.steps, args.warmup
    )
    print("\n".join(report(result) + notes))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
