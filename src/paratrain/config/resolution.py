"""Filling in the automatic fields, and nothing else: the checks are paratrain/validate/.

`resolve` never refuses. A field it cannot fill (dp when the other degrees do not divide the
world size, K when G is not a multiple of b * dp) stays as given, and `validate.check`
names what is wrong in the user's words.
"""

from __future__ import annotations

import copy

from paratrain.config.choices import AUTO
from paratrain.config.parallel_config import ParallelConfig
from paratrain.config.run import RunConfig
from paratrain.config.train_fields import TrainConfig


def resolve(cfg: RunConfig, world_size: int, cuda: bool | None = None) -> RunConfig:
    """A copy of cfg with device, backend and dtype (auto), dp (0) and the batch's G and K
    (either from the other) filled in; cfg is left as it was.

    cuda: whether this machine has a CUDA device; default: ask torch (validate passes
    machine.py's answer, which loads torch only where a GPU driver is).
    """
    if cuda is None:
        import torch  # only here: the configuration itself needs no torch

        cuda = torch.cuda.is_available()
    out = copy.deepcopy(cfg)
    _fill_device(out.parallel, out.train, cuda)
    _fill_dp(out.parallel, world_size)
    _fill_batch(out.train, out.parallel)
    return out


def _fill_device(p: ParallelConfig, t: TrainConfig, cuda: bool) -> None:
    """Device first (auto: cuda when present), then the backend and dtype it implies."""
    if p.device == AUTO:
        p.device = "cuda" if cuda else "cpu"
    if p.backend == AUTO:
        p.backend = "nccl" if p.device == "cuda" else "gloo"
    if t.dtype == AUTO:
        t.dtype = "bfloat16" if p.device == "cuda" else "float32"
    t.muon_ns_dtype = muon_ns_dtype(t.muon_ns_dtype, p.device)


def muon_ns_dtype(given: str, device: str) -> str:
    """Muon's Newton-Schulz precision: as given, or (auto) torch.optim.Muon's bfloat16 on
    cuda and float32 on the CPU, where bfloat16 matrix products have no fast kernel on
    most CPUs (measured on an AVX2 EPYC: 20-30x slower than float32 at 128-512 wide)."""
    if given != AUTO:
        return given
    return "bfloat16" if device == "cuda" else "float32"


def _fill_dp(p: ParallelConfig, world_size: int) -> None:
    others = p.pp * p.cp * p.tp
    if p.dp == 0 and others > 0 and world_size % others == 0:
        p.dp = world_size // others


def replicas(p: ParallelConfig) -> int:
    """Ranks that hold a replica of the model: dp, less the parameter server when async."""
    return p.dp - 1 if p.dp_mode == "async" else p.dp


def _fill_batch(t: TrainConfig, p: ParallelConfig) -> None:
    """G sequences per step, b per micro-batch, K = G / (b * replicas) per replica: G from a
    given K when G is 0, K from G when K is 0 (a K given beside G is checked, not replaced)."""
    per_pass = t.micro_batch * replicas(p)
    if per_pass <= 0:
        return
    if t.microbatches and not t.global_batch:
        t.global_batch = t.microbatches * per_pass
    if not t.microbatches and t.global_batch % per_pass == 0:
        t.microbatches = t.global_batch // per_pass
