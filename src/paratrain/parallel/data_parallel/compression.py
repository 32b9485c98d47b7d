"""Error-feedback compression of the data-parallel gradient reductions.

`--compress` replaces a wrapper's gradient all-reduce (DP, ZeRO-0), reduce-scatter (ZeRO-1
and 2) or HSDP's all-reduce across the replica groups by one that sends fewer bytes:
- powersgd: a rank-r approximation of each matrix, two small all-reduces (powersgd.py);
- int8 and sign: each rank's vector in a codec (comm/codecs.py: int8 with a scale per 256
  elements; one bit per element with the block's mean |x|), reduce-scattered as bytes
  (comm/low_precision.py); an all-reduce then gathers the owners' means, encoded again.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, arXiv:1901.09847): what a
rank's compression loses is added to its next gradient, so nothing is lost, only late.
Each rank keeps, per reduced buffer, its error e: it compresses v = g + e, and e becomes
v minus what its compression kept of v (for PowerSGD, v minus the approximated mean, as
PyTorch's hook does). An all-reduce in a codec rounds the owners' means once more; each
owner keeps that rounding too (1-bit Adam's "server error", arXiv:2102.02888). So at
every step, summed over steps, the applied updates plus the current errors (the ranks'
mean worker error and the owners' server errors) equal the sum of the true mean
gradients: the invariant tests/test_compression.py checks.

The first `start` steps reduce exactly (the errors stay zero; PowerSGD's Q keeps its
seeded start). The state (errors, server errors, PowerSGD's Q factors) is this rank's own
and is checkpointed under the rank's keys (checkpoint/training_state.py); the step count
comes back from the checkpoint's step (checkpoint/load.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paratrain import comm
from paratrain.comm.codecs import CODECS
from paratrain.comm.low_precision import (
    encode_chunks,
    gather_encoded,
    subtract_decoded,
    sum_encoded,
)
from paratrain.comm.traffic import chunk_sizes
from paratrain.config.choices import COMPRESS_METHODS
from paratrain.parallel.data_parallel.powersgd import (
    Matrix,
    exact_ranges,
    first_factors,
    matrices_of,
    powersgd_mean,
)


@dataclass(frozen=True)
class CompressSettings:
    method: str  # powersgd, or a codec of comm/codecs.py: int8, sign
    rank: int = 1  # PowerSGD's rank
    start: int = 0  # steps reduced exactly before compression starts
    seed: int = 0  # PowerSGD's first Q

    def __post_init__(self) -> None:
        valid = [m for m in COMPRESS_METHODS if m != "none"]
        if self.method not in valid:
            raise ValueError(f"compression {self.method!r}; valid: {', '.join(valid)}")


def compress_settings(method: str, rank: int, start: int, seed: int) -> CompressSettings | None:
    """--compress's settings, None for "none"."""
    return None if method == "none" else CompressSettings(method, rank, start, seed)


@dataclass(frozen=True)
class Reduced:
    """One buffer a wrapper reduces through the compressor, under `key`.

    owned: the elements whose mean this rank encodes a second time in a codec all-reduce
    (its chunk), 0 for a reduce-scatter; matrices: PowerSGD's (powersgd.py)."""

    key: str
    numel: int
    owned: int = 0
    matrices: list[Matrix] = field(default_factory=list)


def reduced_buffer(
    key: str,
    shapes: list[tuple[int, torch.Size]],
    numel: int,
    group: comm.CommGroup,
    whole: bool,
    settings: CompressSettings,
) -> Reduced:
    """A flat buffer of `numel` elements holding tensors of `shapes` at their offsets,
    reduced over `group` whole (an all-reduce) or not (a reduce-scatter)."""
    owned = chunk_sizes(numel, group.size)[group.rank] if whole else 0
    powersgd = settings.method == "powersgd"
    return Reduced(key, numel, owned, matrices_of(shapes, settings.rank) if powersgd else [])


class GradCompressor:
    """One wrapper's compressed reductions and their state (see the module docstring)."""

    def __init__(
        self, settings: CompressSettings, buffers: list[Reduced], device: torch.device
    ) -> None:
        self.settings, self.steps = settings, 0
        self.buffers = {b.key: b for b in buffers}
        f32 = torch.float32  # whatever the gradients' dtype: they are reduced in float32
        self.errors = {b.key: torch.zeros(b.numel, dtype=f32, device=device) for b in buffers}
        self.server: dict[str, torch.Tensor] = {}
        self.factors: dict[str, list[torch.Tensor]] = {}
        for i, b in enumerate(buffers):
            if settings.method == "powersgd":
                qs = first_factors(b.matrices, settings.rank, settings.seed + i, device)
                self.factors[b.key] = qs
            elif b.owned:
                self.server[b.key] = torch.zeros(b.owned, dtype=f32, device=device)

    @property
    def active(self) -> bool:
        return self.steps >= self.settings.start

    def finish_step(self) -> None:
        self.steps += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of this rank's state, by a name within the wrapper (views)."""
        out = {f"error.{k}": e for k, e in self.errors.items()}
        out |= {f"server.{k}": s for k, s in self.server.items()}
        for k, qs in self.factors.items():
            out |= {f"q.{k}.{i}": q for i, q in enumerate(qs)}
        return out

    @torch.no_grad()
    def reduce(
        self, key: str, flat: torch.Tensor, group: comm.CommGroup, op: str, sizes: list[int] | None
    ) -> torch.Tensor:
        """The compressed mean (op "avg") or sum ("sum") of float32 `flat` over `group`:
        whole (sizes None, an all-reduce) or this rank's chunk of `sizes` (a reduce-scatter).
        Collective; updates this rank's error."""
        if self.settings.method == "powersgd":
            v = flat + self.errors[key]
            mean = self._powersgd(key, v, group)
            self.errors[key].copy_(v - mean)
            buffer = self.buffers[key]
            for a, b in exact_ranges(buffer.numel, buffer.matrices):
                self.errors[key][a:b] = 0  # averaged exactly: nothing lost
            if sizes is not None:
                mean = mean.split(sizes)[group.rank].clone()
        else:
            mean = self._codec_mean(key, flat, group, sizes)
        return mean.mul_(group.size) if op == "sum" else mean  # `mean` is a fresh tensor

    def _powersgd(self, key: str, v: torch.Tensor, group: comm.CommGroup) -> torch.Tensor:
        def average(t: torch.Tensor) -> torch.Tensor:
            comm.all_reduce(t, group, op="avg")
            return t

        return powersgd_mean(v, self.buffers[key].matrices, self.factors[key], average)

    def _codec_mean(
        self, key: str, flat: torch.Tensor, group: comm.CommGroup, sizes: list[int] | None
    ) -> torch.Tensor:
        """The error buffer becomes v = g + e in place, then, chunk by chunk, what the
        encoding lost of v: no float32 copy of the vector beside the gradient and the
        error (the reduction's peak: plan/codec_bytes.py `codec_mean_peak_bytes`)."""
        codec, k = CODECS[self.settings.method], group.size
        chunks = sizes if sizes is not None else chunk_sizes(flat.numel(), k)
        v = self.errors[key].add_(flat)
        sent = encode_chunks(v, codec, chunks)
        if k == 1:
            mine = codec.decode(sent[0], chunks[0])
            v.sub_(mine)
        else:
            subtract_decoded(v, sent, codec, chunks)
            mine = sum_encoded(sent, group, codec, chunks).div_(k)
        del sent  # gone to their owners: not held beside the all-gather
        if sizes is not None:
            return mine
        w = self.server[key].add_(mine)  # the owner's mean plus its error, then its new error
        del mine
        encoded = codec.encode(w)
        w.sub_(codec.decode(encoded, w.numel()))
        return gather_encoded(encoded, group, codec, chunks)


def compressor_state(compressor: GradCompressor | None) -> list[torch.Tensor]:
    """What a wrapper's compressor holds (none without one): its memory report counts it."""
    return [] if compressor is None else list(compressor.state_tensors().values())
