"""Float32 vectors as fewer bytes, for collectives that may round (comm/low_precision.py).

Each codec turns a 1-D float32 tensor of n elements into `nbytes(n)` bytes (uint8) and
back, the same on every backend (bytes cross gloo as well as NCCL):
- bfloat16: the top 16 bits, rounded to nearest even; relative error at most 2^-8;
- int8: blocks of BLOCK elements, each with a float32 scale absmax / 127 and the codes
  round(x / scale) in [-127, 127]; error at most scale / 2;
- fp4: blocks of BLOCK elements, each with a float32 scale absmax / 6 and E2M1 codes (sign
  and magnitude in {0, 0.5, 1, 1.5, 2, 3, 4, 6}, to nearest, two per byte); error at most
  scale (half the widest gap, between 4 and 6);
- sign: blocks of BLOCK elements, each with a float32 scale, the mean of |x| over the
  block, and one bit per element (0 for x >= 0), eight per byte: x becomes +-scale, the
  scaled sign of EF-SignSGD (Karimireddy et al. 2019, arXiv:1901.09847), the scale that
  minimises the block's squared error among +-c; error at most absmax + scale.
A block of zeros has scale 0 and decodes to zeros. The scales follow the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256  # elements per scale: int8 3.94x fewer bytes than float32, fp4 7.76x
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1's magnitudes
FP4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(FP4_VALUES[:-1], FP4_VALUES[1:], strict=True))


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int  # per element, beside the scales
    scaled: bool  # a float32 scale per BLOCK elements

    def nbytes(self, n: int) -> int:
        scales = 4 * -(-n // BLOCK) if self.scaled else 0
        return -(-n * self.bits // 8) + scales

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`nbytes(len(x))` bytes for float32 `x` (1-D)."""
        if x.numel() == 0:  # a rank's empty chunk
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        if self.name == "bfloat16":
            return x.to(torch.bfloat16).view(torch.uint8)
        if self.name == "sign":
            return torch.cat([_sign_bits(x), _mean_abs(x).view(torch.uint8)])
        blocks, scales = _blocks(x, 127.0 if self.name == "int8" else 6.0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        y = (blocks / safe).reshape(-1)[: x.numel()]
        codes = _int8(y) if self.name == "int8" else _fp4(y)
        return torch.cat([codes, scales.view(torch.uint8)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 values of `n` elements encoded in `data`."""
        if n == 0:
            return torch.empty(0, dtype=torch.float32, device=data.device)
        if self.name == "bfloat16":  # a copy: a slice of a byte buffer may sit at any offset
            return data.clone().view(torch.bfloat16).float()
        count = -(-n // BLOCK)
        codes, scales = data[: -4 * count], data[-4 * count :].clone().view(torch.float32)
        if self.name == "int8":
            y = codes.view(torch.int8).float()
        elif self.name == "sign":
            y = _sign_values(codes, n)
        else:
            y = _fp4_values(codes, n)
        padded = torch.zeros(count * BLOCK, dtype=torch.float32, device=data.device)
        padded[:n] = y
        return (padded.view(count, BLOCK) * scales.unsqueeze(1)).reshape(-1)[:n]


CODECS = {
    "bfloat16": Codec("bfloat16", 16, False),
    "int8": Codec("int8", 8, True),
    "fp4": Codec("fp4", 4, True),
    "sign": Codec("sign", 1, True),
}


def _blocks(x: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x zero-padded into (blocks, BLOCK) and each block's scale absmax / top."""
    count = -(-x.numel() // BLOCK)
    padded = torch.zeros(count * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    blocks = padded.view(count, BLOCK)
    return blocks, blocks.abs().amax(dim=1) / top


def _int8(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp_(-127, 127).to(torch.int8).view(torch.uint8)


def _fp4(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each y in [-6, 6] (ties to the smaller magnitude), as a sign
    bit over a 3-bit magnitude index, two codes per byte (the first in the low nibble).
    The index counts the midpoints below |y| (bucketize: one at |y| is not), which the
    nearest value's index is; an argmin over the eight distances made two float32
    (n, 8) matrices (DiLoCo's fp4 outer step peaked there) and gave the same codes."""
    midpoints = torch.tensor(FP4_MIDPOINTS, device=y.device)
    index = torch.bucketize(y.abs(), midpoints, out_int32=True).to(torch.uint8)
    codes = index | ((y < 0).to(torch.uint8) << 3)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _fp4_values(packed: torch.Tensor, n: int) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:n]
    values = torch.tensor(FP4_VALUES, device=packed.device)[(codes & 7).long()]
    return torch.where((codes >> 3).bool(), -values, values)


def _mean_abs(x: torch.Tensor) -> torch.Tensor:
    """Each block's mean |x| over its own elements (the last block may be short)."""
    blocks, _ = _blocks(x, 1.0)
    count = blocks.shape[0]
    sizes = torch.full((count,), float(BLOCK), device=x.device)
    sizes[-1] = x.numel() - (count - 1) * BLOCK
    return blocks.abs().sum(dim=1) / sizes


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """One bit per element, set where x < 0, eight per byte (the first in bit 0)."""
    bits = (x < 0).to(torch.uint8)
    pad = -x.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=x.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _sign_values(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n]
    return 1.0 - 2.0 * bits.float()
