"""A Llama-family decoder in plain PyTorch: RMSNorm, rotary positions, SwiGLU, grouped-query
attention, no biases (Touvron et al., arXiv:2302.13971; Llama 3, arXiv:2407.21783).

The same contract as models/gpt.py: `forward(ids, targets)` returns the mean token loss
(logits without targets); a pipeline split sets the ends (`tok_emb`, `norm`, `head`) to
None and a stage then takes or returns hidden states; parallelism is applied from outside
through models/plans.py's LLAMA_PLAN, so the module knows nothing of devices or groups.

Module names follow Hugging Face's LlamaForCausalLM without its `_proj` suffixes
(`attn.q` for `self_attn.q_proj`, `mlp.gate` for `mlp.gate_proj`), and the rotary layout
is Hugging Face's: each head's dimensions are rotated as two halves (`rotate_half`), with
frequency theta^(-2i/d) for the pair (i, i + d/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.kv_cache import KVCache, LayerCache
from paratrain.models.moe import MoEConfig, MoEFeedForward, add_aux_loss
from paratrain.models.position_dependent import CoreAttention, Positions, extra_arguments
from paratrain.token_rows import IGNORE_INDEX


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # key/value heads, shared by n_head / n_kv_head query heads each
    d_model: int = 128
    ffn_hidden: int = 352  # SwiGLU's inner width (about 8/3 d_model)
    max_seq_len: int = 256  # longest sequence trained on (rotary positions have no table)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moe: MoEConfig | None = None  # every block's SwiGLU a mixture of experts; None: dense

    def __post_init__(self) -> None:
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"Llama: n_head {self.n_head} must divide d_model {self.d_model}, and "
                f"n_kv_head {self.n_kv_head} must divide n_head"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate (B, heads, T, hd) by each position's angles, Hugging Face's half layout
    (`rotary_angles`, then `rotate`)."""
    return rotate(x, *rotary_angles(x, theta, positions))


def rotary_angles(
    x: torch.Tensor, theta: float, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) in x's dtype for rotating tensors shaped like x (B, heads, T, hd): once
    per layer for its queries and keys alike (twice cost 1% of llama-tiny's forward and
    backward).

    The angles are computed here in float32 from the T tokens' global positions (no table
    to move between devices or to checkpoint): 0..T-1 in training, where attention sees
    the whole sequence (sequence parallelism gathers it first), or this rank's chunks of
    it under context parallelism; in decoding the new positions follow the cached ones;
    (B, T) with packed documents, each token's position in its document. None: 0..T-1.
    """
    hd = x.shape[-1]
    if positions is None:
        positions = torch.arange(x.shape[-2], device=x.device)
    # Hugging Face's arithmetic, step by step, so that imported models agree to the bit.
    exponents = torch.arange(0, hd, 2, device=x.device, dtype=torch.int64).float() / hd
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq  # (T, hd/2), or (B, T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # pair (i, i + hd/2) shares one
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # (B, 1, T, hd): the same for every head
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head  # read by tensor parallelism
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        kv = cfg.n_kv_head * cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, kv, bias=False)
        self.v = nn.Linear(cfg.d_model, kv, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # Replaceable, both: context parallelism swaps them (models/position_dependent.py).
        self.positions, self.core = Positions(), CoreAttention()

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions` (B, T): packed documents' (token_rows.document_positions)."""
        batch, seq, _ = x.shape
        hd = self.head_dim
        past = cache.length if cache is not None else 0

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, h * hd) -> (B, h, T, hd)
            return t.view(batch, seq, -1, hd).transpose(1, 2)

        # Head counts from the outputs: under tensor parallelism each rank holds n_head/tp
        # query heads and n_kv_head/tp key/value heads, the same groups as unsplit.
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        where = self.positions(seq, past, x.device) if positions is None else positions
        cos, sin = rotary_angles(q, self.theta, where)  # q's and k's: the same positions
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:  # decoding: the cached positions' keys and values, extended
            k, v = cache.extend(k, v)
        # (B, h, T, hd); query head i reads kv head i // group; packed documents by mask
        extra = (0, 0.0, positions) if positions is not None else (past,)
        y = self.core(q, k, v, *extra)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, arXiv:2002.05202)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp: nn.Module = SwiGLU(cfg) if cfg.moe is None else MoEFeedForward(cfg.moe)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.attn_norm(x)  # the cache only when decoding, as in gpt.py's Block
        x = x + self.attn(h, *extra_arguments(cache, positions))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg) for i in range(cfg.n_layer)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # Llama 3.2 1B and 3B tie them
            self.head.weight = self.tok_emb.weight
        self.loss_fn: nn.Module = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # RMSNorm weights start at one
            # As the GPT: N(0, 0.02), the residual projections scaled by 1/sqrt(2 L).
            residual = name.endswith(("attn.o.weight", "mlp.down.weight"))
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy if targets given;
        on a pipeline stage without embeddings x is hidden states, and one without a head
        returns them. With a `cache` (decoding), x is the positions after the cached ones;
        with `positions` (B, T), x holds packed documents, each attending only to itself."""
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # (B, T, C)
        for i, block in enumerate(self.blocks.values()):
            layer = cache.layers[i] if cache is not None else None
            x = block(x, *extra_arguments(layer, positions))
        if self.norm is None or self.head is None:
            return x
        logits = self.head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = self.loss_fn(logits.flatten(0, 1), targets.flatten())
        return loss if self.cfg.moe is None else add_aux_loss(self, loss)
