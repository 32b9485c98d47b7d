"""Tensor-parallel GPT training equals single-process training; its traffic is Megatron's.

Exact in this setup: the initial weights (every rank builds the full model from the same
seed and keeps its slice) and the data (every tp rank sees the whole global batch).
Equal to float32 rounding: losses, gradient norms and parameters (gathered back whole),
because split matmuls, all-reduced partial sums and the vocabulary-split softmax add the
same terms in a different order (tolerances in equivalence.py). Adam is elementwise, so
optimizing shards is optimizing the whole; only the gradient norm for clipping needs the
group (train/clip.py), and under sequence parallelism the partial gradients of replicated
parameters their sum over it.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.data.tokens import BatchSampler
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.plans import GPT_TP_PLAN
from paratrain.parallel.tensor_parallel import apply_tensor_parallel, full_state_dict
from paratrain.train.build import data_parallel
from paratrain.train.engine import FlatEngine
from paratrain.train.step import train_step
from tests.distributed import run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_lr,
    reference_training,
    tiny_config,
    tiny_data,
)

REPLICATED_SUFFIXES = ("ln1.weight", "ln2.bias", "norm.weight", "pos_emb.weight", "proj.bias")


def _model(cfg, group, sp: bool, dropout: float = 0.0) -> GPT:
    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)  # the same full model on every rank, then sliced
    model = GPT(GPTConfig(m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len, dropout))
    return apply_tensor_parallel(model, GPT_TP_PLAN, group, sequence_parallel=sp, seed=t.seed)


def train_tp(rank, k, cfg, data, sp, dropout=0.0, skip_sync=False):
    """The one training step (train/step.py) on a tensor-parallel model; every tp rank
    takes the whole global batch (a data-parallel group of one)."""
    mesh = Mesh.build(tp=k)
    group, t = mesh.group("tp"), cfg.train
    model = _model(cfg, group, sp, dropout)
    engine = FlatEngine(data_parallel(model, mesh.group("dp"), cfg), group)
    if skip_sync:  # break the property on purpose: leave the partial gradients partial
        engine._complete_partial_grads = lambda: None
    opt = engine.build_optimizer(t.lr, t.weight_decay, (t.beta1, t.beta2))
    # Dropout masks must come from the tracker alone: a rank-dependent default stream
    # (as the training loop seeds it) must not matter.
    torch.manual_seed(1000 + rank)
    sampler = BatchSampler(data.train, t.seq_len, t.global_batch, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        batch = sampler.global_batch_at(step)  # the same batch on every tp rank
        out = train_step(engine, opt, [batch], reference_lr(step, cfg), t.grad_clip)
        losses.append(out.loss)
        norms.append(out.grad_norm)
    # Evaluation under tensor parallelism: the vocabulary-split loss in eval mode.
    model.eval()
    val = data.val[: t.seq_len + 1].long().view(1, -1)
    with torch.no_grad():
        val_loss = model(val[:, :-1], val[:, 1:]).item()
    replicated = {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n.endswith(REPLICATED_SUFFIXES)
    }
    state = full_state_dict(model, group)  # whole parameters for the comparison
    return RunRecord(losses, norms, state), val_loss, replicated


def _plain_eval(cfg, state, data) -> float:
    m, t = cfg.model, cfg.train
    model = GPT(GPTConfig(m.vocab_size, m.n_layer, m.n_head, m.d_model, m.max_seq_len))
    model.load_state_dict(state)
    model.eval()
    val = data.val[: t.seq_len + 1].long().view(1, -1)
    with torch.no_grad():
        return model(val[:, :-1], val[:, 1:]).item()


@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.equivalence), 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_training_matches_single_process(k, sp):
    cfg = tiny_config()
    cfg.model.n_head = 4  # tp = 4 needs whole heads on every rank
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    for record, val_loss, _ in run_distributed(train_tp, k, cfg, data, sp):
        assert_equivalent(record, reference, initial)
        # Evaluation with split logits equals the plain model with the same weights.
        plain = _plain_eval(cfg, record.state, data)
        assert math.isclose(val_loss, plain, rel_tol=2e-6), (val_loss, plain)


def test_sequence_parallel_without_the_gradient_sum_is_caught():
    """Under sequence parallelism a LayerNorm sees T/tp tokens: skipping the sum of its
    gradient over the group must break equivalence (so the test above can see it)."""
    cfg = tiny_config()
    data = tiny_data()
    reference, initial = reference_training(cfg, data)
    record, _, _ = run_distributed(train_tp, 2, cfg, data, True, 0.0, True)[0]
    with pytest.raises(AssertionError):
        assert_equivalent(record, reference, initial)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_keeps_replicated_parameters_identical_across_ranks(sp):
    """With dropout on, replicated regions draw one mask for all tp ranks: the replicated
    parameters (LayerNorm, position embedding, row-parallel biases) stay bitwise equal.
    A rank-dependent mask there would make their gradients, and then them, differ."""
    cfg = tiny_config(steps=3)
    data = tiny_data()
    results = run_distributed(train_tp, 2, cfg, data, sp, 0.2)
    (first, _, rep0), (_, _, rep1) = results
    assert rep0.keys() == rep1.keys() and len(rep0) >= 5
    for name, value in rep0.items():
        assert torch.equal(value, rep1[name]), f"{name} differs between tp ranks"
    reference, _ = reference_training(cfg, data)  # no dropout: a different but close run
    assert all(math.isfinite(x) for x in first.losses)
    assert first.losses != reference.losses  # dropout did act


def _masks(rank, k):
    from paratrain.parallel.tensor_parallel import RngTracker

    tracker = RngTracker(seed=5, tp_rank=rank)
    torch.manual_seed(100 + rank)  # the default stream differs per rank
    expected_default = torch.get_rng_state()
    with tracker.fork("replicated"):
        replicated = torch.rand(8)
    with tracker.fork("split"):
        split = torch.rand(8)
    with tracker.fork("replicated"):  # the stream continues, it does not restart
        replicated_again = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), expected_default), "default stream disturbed"
    assert not torch.equal(replicated, replicated_again)
    return replicated, split


def test_rng_tracker_replicated_streams_agree_and_split_streams_differ():
    (rep0, split0), (rep1, split1) = run_distributed(_masks, 2)
    assert torch.equal(rep0, rep1)
    assert not torch.equal(split0, split1)


def _block_traffic(rank, k, sp, n_layer):
    cfg = tiny_config()
    cfg.model.n_layer, cfg.model.n_head = n_layer, 4
    mesh = Mesh.build(tp=k)
    model = _model(cfg, mesh.group("tp"), sp)
    batch = BatchSampler(tiny_data().train, 16, 2, 0).global_batch_at(0)  # (B=2, T+1=17)
    passes = {}
    for name in ("forward", "backward"):
        seen = len(mesh.ledger.recent())
        mesh.ledger.reset()
        if name == "forward":
            loss = model(batch[:, :-1], batch[:, 1:])
        else:
            loss.backward()
        records = mesh.ledger.recent()[seen:]
        totals = mesh.ledger.totals()
        passes[name] = (
            [(r.op, r.shapes) for r in records],
            {op: (t.calls, t.bytes_sent) for (_, op), t in totals.items()},
        )
    return passes


@pytest.mark.parametrize("n_layer", [1, 3])
def test_each_block_all_reduces_twice_forward_and_twice_backward(n_layer):
    """Megatron's count: g after attention and after the MLP in forward, f before each in
    backward, each of B*T*C elements; plus one for the vocabulary-split embedding (forward)
    and one for the head's input (backward), and the loss's per-token statistics."""
    k, B, T, C = 2, 2, 16, 32
    passes = run_distributed(_block_traffic, k, False, n_layer)[0]
    activation = f"float32[{B}, {T}, {C}]"
    fwd_ops, _ = passes["forward"]
    bwd_ops, _ = passes["backward"]
    assert fwd_ops.count(("all_reduce", activation)) == 2 * n_layer + 1
    assert bwd_ops.count(("all_reduce", activation)) == 2 * n_layer + 1
    others = [op for op in fwd_ops + bwd_ops if op != ("all_reduce", activation)]
    assert others == [("all_reduce", f"float32[{B * T}]"), ("all_reduce", f"float32[2, {B * T}]")]


@pytest.mark.parametrize("k", [2, 4])
def test_sequence_parallel_moves_the_same_bytes_as_all_reduce(k):
    """Each all-reduce becomes an all-gather plus a reduce-scatter, each (k-1)/k of the
    activation per rank, so the total per pass is unchanged (arXiv:2205.05198, 4.2.2)."""
    n_layer = 2
    plain = run_distributed(_block_traffic, k, False, n_layer)[0]
    seq = run_distributed(_block_traffic, k, True, n_layer)[0]
    for name in ("forward", "backward"):
        _, ar = plain[name]
        _, sp = seq[name]
        ag_calls, ag_bytes = sp["all_gather"]
        rs_calls, rs_bytes = sp["reduce_scatter"]
        assert ag_calls == rs_calls == 2 * n_layer + 1
        loss_bytes = sp.get("all_reduce", (0, 0))[1]  # the loss statistics, in both runs
        assert ag_bytes + rs_bytes + loss_bytes == ar["all_reduce"][1], name
        assert ar["all_reduce"][0] == 2 * n_layer + 1 + (2 if name == "forward" else 0)


def _saved_bytes_per_block(rank, k, sp):
    """Bytes of activations saved for backward by one block (2 layers minus 1 layer)."""
    group = Mesh.build(tp=k).group("tp")
    ids = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    saved = []
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(256, n_layer, n_head=4, d_model=64, max_seq_len=64))
        apply_tensor_parallel(model, GPT_TP_PLAN, group, sequence_parallel=sp)
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


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_sequence_parallel_splits_the_layernorm_inputs(sp):
    """Saved activations per block, float32, no dropout, CPU's fused attention (q, k, v and
    the output saved, no (T, T) scores), in units of sbh = T * B * C floats:
    tp: LayerNorm inputs and outputs whole (4) + q, k, v, attention output, fc output,
    gelu output split (12 / t). tp+sp: LayerNorm inputs split (2 / t), their gathered
    outputs whole (2): we keep the gathered tensor for the column-parallel weight gradient
    where Megatron keeps the local part and all-gathers it again in backward."""
    k, sbh = 2, 64 * 2 * 64 * 4  # bytes of one (B, T, C) float32 activation
    expected = (2 + 2 / k + 12 / k) if sp else (4 + 12 / k)
    measured = run_distributed(_saved_bytes_per_block, k, sp)[0] / sbh
    # The rest is per-token statistics: LayerNorm mean and rstd, attention's logsumexp.
    assert expected <= measured <= expected * 1.02, (measured, expected)
