"""`paratrain bench model`: the pairs, and the checks that make them a comparison.

Each model is built from its preset (ours, from the run's seed), its small parameters
(biases, norm weights) moved off their initial zeros and ones so that every weight's place
in the twin matters, and converted into transformers' twin (peer.py). Both then run in
this process, on the same random token batches and the same threads:

- forward and backward: the gradients set to None, one micro-batch's mean token loss,
  its backward; no update, so every pair computes the same function on the same weights;
- a whole step (`--what step`): ours is `train_step` through a one-rank engine as in
  `bench overhead`, the peer torch's plain loop (harness/sides.py: `torch_step`), both
  with AdamW (foreach) and clipping.

Pairs alternate which side goes first (harness/pairs.py). Before timing, both models run
one forward in float64 on the first batch: they must agree within float64 rounding, so a
weight in the wrong place, a missing bias or another activation fails the bench at once.
"""

from __future__ import annotations

import copy
import logging
from typing import Any
from unittest import mock

import torch
from torch import nn

from paratrain.bench.harness.pairs import check_losses, ratio_summary, time_pairs
from paratrain.bench.harness.sides import torch_step
from paratrain.bench.model.peer import transformers_twin
from paratrain.config import ModelConfig, RunConfig
from paratrain.mesh import Mesh
from paratrain.models.presets import ffn_width, preset
from paratrain.parallel.data_parallel import DataParallel
from paratrain.parallel.data_parallel.adamw import adamw
from paratrain.train.build import build_model
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step

log = logging.getLogger(__name__)
WHAT = ("fwd-bwd", "step")
# Presets with a transformers twin (a mixture of experts has none in GPT-2 or Llama).
TWINNED = ("gpt-tiny", "llama-tiny", "gpt2-124m", "llama3-1b", "llama3-8b", "llama3-70b")
FLOAT32_UNIT, FLOAT64_UNIT = 2.0**-24, 2.0**-53
# Whole steps drift apart as AdamW amplifies roundings: harness/pairs.py's screen.
STEP_LOSS_RTOL = 1e-4
Batch = list[torch.Tensor]


def rounding_bound(m: ModelConfig, seq_len: int, unit: float) -> float:
    """A first-order bound on the relative difference of two losses computed by the same
    arithmetic in another order: each of D sequential reductions of at most K terms moves
    its result by at most K u relative (Higham's gamma_K), so D K u. D: per block the
    q/k/v and output projections, the scores and their weighted sum, the two MLP matmuls
    (three for SwiGLU), the two norms; then the final norm, the head and the loss's sum
    over the vocabulary. K: the widest of them."""
    depth = 9 * m.n_layer + 3
    widest = max(m.d_model, ffn_width(m), seq_len, m.vocab_size)
    return depth * widest * unit


def bench_config(name: str, seq_len: int, batch: int) -> RunConfig:
    """The default run configuration on the preset `name`, one micro-batch of `batch`."""
    try:
        fields = preset(name)
    except ValueError:
        raise ValueError(f"--models {name!r}; valid: {', '.join(TWINNED)}") from None
    if name not in TWINNED:
        raise ValueError(f"--models {name!r} has no transformers twin; valid: {', '.join(TWINNED)}")
    cfg = RunConfig()
    cfg.model = ModelConfig(name=name, **fields)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = seq_len, batch, batch
    cfg.train.microbatches = 1
    return cfg


def _off_defaults_(model: nn.Module, seed: int) -> None:
    """Move 1-D parameters (zero biases, unit norm weights) by N(0, 0.1): a bias or norm
    weight in the wrong place would then change the loss."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen).mul(0.1))


def _batches(vocab: int, seq_len: int, batch: int, count: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)] for _ in range(count)]


def fwd_bwd(model: nn.Module) -> Any:
    """Forward and backward of one micro-batch; the loss on the host."""

    def side(micro_batches: Batch) -> float:
        model.zero_grad(set_to_none=True)
        (batch,) = micro_batches
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        return float(loss.item())

    return side


def float64_agreement(ours: nn.Module, peer: nn.Module, batch: torch.Tensor) -> float:
    """Relative difference of the two models' float64 losses on `batch` (copies).

    transformers' LlamaRMSNorm computes in float32 whatever its input (for 16-bit inputs),
    which in float64 would be a float32 rounding, not another function: for this check
    it runs in its input's precision."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def rms_norm_as_given(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    with torch.no_grad(), mock.patch.object(LlamaRMSNorm, "forward", rms_norm_as_given):
        a = copy.deepcopy(ours).double()(batch[:, :-1], batch[:, 1:]).item()
        b = copy.deepcopy(peer).double()(batch[:, :-1], batch[:, 1:]).item()
    return abs(a - b) / abs(b)


def step_sides(cfg: RunConfig, ours: nn.Module, peer: nn.Module) -> tuple[Any, Any]:
    """Whole optimizer steps: ours through a one-rank engine, the peer's plain loop."""
    t = cfg.train
    betas = (t.beta1, t.beta2)
    engine = FlatEngine(DataParallel(ours, Mesh.build(dp=1).group("dp"), reduce_op="sum"))
    ours_opt = engine.build_optimizer(t.lr, t.weight_decay, betas)
    peer_opt = adamw(peer, t.lr, t.weight_decay, betas)

    def our_step(micro_batches: Batch) -> float:
        return train_step(engine, ours_opt, micro_batches, t.lr, t.grad_clip).loss

    def peer_step(micro_batches: Batch) -> float:
        return torch_step(peer, peer_opt, micro_batches, t.lr, t.grad_clip)

    return our_step, peer_step


def bench_one(name: str, pairs: int, seq_len: int, batch: int, what: list[str]) -> dict:
    cfg = bench_config(name, seq_len, batch)
    m = cfg.model
    ours = build_model(cfg)
    _off_defaults_(ours, cfg.train.seed)
    peer, peer_line = transformers_twin(m, ours)
    data = _batches(m.vocab_size, seq_len, batch, pairs + 1, cfg.train.seed)
    result: dict[str, Any] = {"model": name, "peer": peer_line, "seq_len": seq_len}
    result["batch"] = batch
    agreement = float64_agreement(ours, peer, data[0][0])
    bound64 = rounding_bound(m, seq_len, FLOAT64_UNIT)
    log.info("%s: %s; float64 losses %.1e apart (bound %.1e)", name, peer_line, agreement, bound64)
    if not agreement <= bound64:
        raise RuntimeError(f"{name}: float64 losses {agreement:.1e} apart > {bound64:.1e}")
    result["float64_relative"] = agreement
    for mode in what:
        if mode == "fwd-bwd":
            sides = fwd_bwd(ours), fwd_bwd(peer)
            rtol = rounding_bound(m, seq_len, FLOAT32_UNIT)
        else:  # each side trains its own copy from the same weights
            sides = step_sides(cfg, copy.deepcopy(ours), copy.deepcopy(peer))
            rtol = STEP_LOSS_RTOL
        sides[0](data[0]), sides[1](data[0])  # warm-up, not timed
        rows = time_pairs(sides[0], sides[1], data[1:])
        check_losses([r.ours_loss for r in rows], [r.peer_loss for r in rows], rtol, f"{name}: ")
        summary = ratio_summary([r.ours_s for r in rows], [r.peer_s for r in rows])
        result[mode] = summary
        log.info(
            "%s %s: ours %.2f ms, transformers %.2f ms, ratio %.3f (quartiles %.3f-%.3f, "
            "range %.3f-%.3f, %d pairs)", name, mode, 1e3 * summary["ours_step_s"],
            1e3 * summary["torch_step_s"], summary["ratio"], summary["ratio_q1"],
            summary["ratio_q3"], summary["ratio_min"], summary["ratio_max"], summary["pairs"],
        )  # fmt: skip
    return result


def run_model_bench(
    names: list[str], pairs: int, seq_len: int, batch: int, what: list[str]
) -> dict[str, Any]:
    bad = [w for w in what if w not in WHAT]
    if bad:
        raise ValueError(f"--what {bad[0]!r}; valid: {', '.join(WHAT)}")
    log.info("threads: %d (both sides, one process)", torch.get_num_threads())
    results = [bench_one(name, pairs, seq_len, batch, what) for name in names]
    return {"threads": torch.get_num_threads(), "models": results}
