"""A small decoder-only transformer (GPT-2 shape, pre-norm), in plain PyTorch.

Parallelism is applied from outside (tensor parallel splits `attn.q/k/v/proj` and
`mlp.fc/proj`; the pipeline takes `blocks` in order), so the model stays readable and
knows nothing about devices or process groups. The ends (`tok_emb`, `pos_emb`, `norm`,
`head`) may be set to None by a pipeline split: a stage without embeddings takes hidden
states as input, a stage without a head returns hidden states.
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
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq_len: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = False  # the output head reuses the token embedding's matrix
    activation: str = "gelu"  # "gelu" (exact, erf) or "gelu_tanh" (GPT-2's approximation)
    moe: MoEConfig | None = None  # every block's MLP a mixture of experts; None: dense


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.core = CoreAttention()  # replaceable: context parallelism swaps it

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions` (B, T): packed documents' (token_rows.document_positions)."""
        batch, seq, _ = x.shape
        # The head count is read from q's output, not the config, so that a layer whose
        # q/k/v keep only some heads (tensor parallel) still splits them correctly. Not
        # from the weight: a DTensor weight reports its global shape.
        head_dim = self.q.weight.shape[1] // self.n_head
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, C_local)
        local_heads = q.shape[-1] // head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, local_heads, head_dim).transpose(1, 2)  # (B, nh, T, hs)

        q, k, v = heads(q), heads(k), heads(v)
        p = self.dropout if self.training else 0.0
        past = 0
        if cache is not None:  # incremental decoding: attend over the cached positions too
            past = cache.length
            k, v = cache.extend(k, v)
        # (B, nh, T, hs); packed documents (training only) through their mask
        extra = (0, p, positions) if positions is not None else (past, p)
        y = self.core(q, k, v, *extra)
        y = y.transpose(1, 2).reshape(batch, seq, local_heads * head_dim)  # (B, T, C_local)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = MLP(cfg) if cfg.moe is None else MoEFeedForward(cfg.moe)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, *extra_arguments(cache, positions)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.positions = Positions()  # replaceable: under context parallelism, this rank's
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # GPT-2's weight tying (Press and Wolf, arXiv:1608.05859)
            self.head.weight = self.tok_emb.weight  # one parameter, two names
        # A module, not a call, so that tensor parallelism can swap in a loss that works on
        # vocabulary-split logits without the model knowing (models/plans.py).
        self.loss_fn: nn.Module = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so that the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy if targets given.

        On a pipeline stage without embeddings x is hidden states (B, T, C); on one
        without a head the hidden states are returned. With a `cache` (decoding), x is
        the positions after the cached ones, whose keys and values are reused and extended.
        With `positions` (B, T), x holds packed documents: each token's position in its
        document, which it alone attends to (token_rows.document_positions).
        """
        past = cache.length if cache is not None else 0
        if self.tok_emb is not None and self.pos_emb is not None:
            where = self.positions(x.shape[1], past, x.device) if positions is None else positions
            x = self.drop(self.tok_emb(x) + self.pos_emb(where))  # (B, T, C)
        for i, block in enumerate(self.blocks.values()):
            layer = cache.layers[i] if cache is not None else None
            x = block(x, *extra_arguments(layer, positions))
        if self.norm is None or self.head is None:
            return x
        logits = self.head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = self.loss_fn(logits.flatten(0, 1), targets.flatten())  # (B*T, V), (B*T,)
        return loss if self.cfg.moe is None else add_aux_loss(self, loss)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
