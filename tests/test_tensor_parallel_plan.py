"""Plans as data: matching, refusals with the sizes named, shard facts, and a user's model.

Most checks here need no communication (slicing a layer is local), so they use a group
object of two ranks without a process group; the user-model test trains on real ranks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from paratrain.comm.group import CommGroup
from paratrain.comm.ledger import Ledger
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_TP_PLAN, check_tensor_parallel
from paratrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    apply_tensor_parallel,
    full_state_dict,
    match_plan,
)
from tests.distributed import run_distributed
from tests.equivalence import RunRecord, Tolerance


def _group(rank: int = 0, size: int = 2) -> CommGroup:
    """A group that is never used to communicate: enough to build (slice) layers."""
    return CommGroup("tp", None, list(range(size)), rank, Ledger())


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"vocab_size": 64, "n_layer": 2, "n_head": 4, "d_model": 32, **kw}))


def test_plan_keeps_parameter_names_and_slices_every_matrix():
    model = _gpt()
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    apply_tensor_parallel(model, GPT_TP_PLAN, _group(rank=1))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert shapes.keys() == full_shapes.keys()
    assert shapes["blocks.0.attn.q.weight"] == (16, 32)  # whole heads 2..3 of 4
    assert shapes["blocks.0.attn.proj.weight"] == (32, 16)
    assert shapes["blocks.1.mlp.fc.bias"] == (64,)
    assert shapes["tok_emb.weight"] == shapes["head.weight"] == (32, 32)  # vocab 64 / 2
    assert shapes["blocks.0.ln1.weight"] == full_shapes["blocks.0.ln1.weight"]  # replicated


def test_shard_facts_are_visible_in_the_repr():
    layer = ColumnParallelLinear(nn.Linear(256, 1024), _group(rank=1))
    assert "tp_rank=1/2" in repr(layer) and "out_features=512 of 1024" in repr(layer)
    model = apply_tensor_parallel(_gpt(), GPT_TP_PLAN, _group())
    assert "num_embeddings=32 of 64 (ids 0..31)" in repr(model.tok_emb)
    assert "in_features=64 of 128" in repr(model.blocks["0"].mlp.proj)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"n_head": 3, "d_model": 48},
            r"blocks.0.attn \(attention\): number of attention "
            r"heads 3 is not divisible by tp=2",
        ),
        (
            {"vocab_size": 65},
            r"tok_emb \(vocab_embedding\): vocabulary 65 is not divisible by tp=2",
        ),
    ],
)
def test_an_odd_split_is_refused_naming_the_sizes(kw, message):
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(_gpt(**kw), GPT_TP_PLAN, _group())


def test_the_config_check_names_every_size_before_workers_start():
    cfg = GPTConfig(vocab_size=257, n_head=6, d_model=96)
    with pytest.raises(ValueError, match="tp=4 must divide: 6 attention heads, vocabulary 257"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="sequence length 30"):
        check_tensor_parallel(GPTConfig(), 4, seq_len=30, sequence_parallel=True)
    check_tensor_parallel(GPTConfig(), 4, seq_len=32, sequence_parallel=True)


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"blocks.*.attn.qq": "colwise"}, "matches no module"),
        ({"head": "diagonal"}, "unknown style 'diagonal'"),
        ({"blocks.*.attn.q": "colwise", "blocks.0.attn.q": "colwise"}, "two patterns"),
        ({"blocks.*.ln1": "colwise"}, "applies to Linear, not LayerNorm"),
        ({"head": "vocab_head"}, "dropout layer drop is not covered"),
    ],
)
def test_a_bad_plan_is_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(_gpt(), plan, _group())


def test_a_star_matches_exactly_one_name_component():
    matches = match_plan(_gpt(), {"blocks.*.mlp.fc": "colwise", "*": "replicated"})
    assert sorted(matches) == [
        "blocks",
        "blocks.0.mlp.fc",
        "blocks.1.mlp.fc",
        "drop",
        "head",
        "loss_fn",
        "norm",
        "pos_emb",
        "positions",  # the parameterless positions piece (models/position_dependent.py)
        "tok_emb",
    ]


def test_the_plan_module_is_pure_data():
    code = "import sys, paratrain.models.plans; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class UserMLP(nn.Module):
    """Somebody's model, written without tensor parallelism in mind."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(10, 32)
        self.ffn = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.out = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))  # (N, 32)
        h = h + self.ffn(h)  # residual around a Megatron MLP
        return self.out(h)  # (N, 6)


USER_PLAN = {"ffn.0": "colwise", "ffn.2": "rowwise", "out": "colwise_gathered"}


def _train_user_model(rank, k, parallel, dtype=torch.float32):
    torch.manual_seed(0)
    model = UserMLP().to(dtype)  # drawn in float32 whatever the dtype
    group = Mesh.build(tp=k).group("tp") if parallel else None
    if parallel:
        apply_tensor_parallel(model, USER_PLAN, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 10, generator=data), torch.randint(0, 6, (16,), generator=data)
        x = x.to(dtype)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = full_state_dict(model, group) if parallel else model.state_dict()
    return losses, state


def test_a_users_model_trains_the_same_with_a_plan():
    """Within tests/equivalence.py's Tolerance of one process, derived from its float32
    run against float64: split matmuls and all-reduces add the same products in another
    order."""
    ref_losses, ref_state = _train_user_model(0, 1, False)
    exact_losses, exact_state = _train_user_model(0, 1, False, torch.float64)
    tol = Tolerance.measured(
        RunRecord(exact_losses, [], exact_state), [RunRecord(ref_losses, [], ref_state)]
    )
    for losses, state in run_distributed(_train_user_model, 2, True):
        assert losses == pytest.approx(ref_losses, rel=tol.loss_rtol)
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            assert (state[name] - value).abs().max().item() <= tol.param_atol, name
