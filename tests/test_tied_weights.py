"""A model whose output head shares the token embedding's matrix (GPT-2's weight tying)
trains equal to one process under every strategy, and every wrapper's full state dict
holds every key of the plain model's, the tied alias included.

The tie survives each strategy in its own way: data parallelism and ZeRO-1/2 keep the one
parameter (named once); FSDP moves it into the root unit, since its two users sit in two
units; tensor parallelism slices embedding and head alike and ties the slices again; the
pipeline keeps a copy on the first and the last stage and sums their gradients between
them, counting the sum once in the global norm. Tolerances: tests/equivalence.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import RunConfig
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.parallel.tensor_parallel import full_state_dict
from paratrain.train.build import build_engine, data_parallel, run_gpt_config
from tests.distributed import run_distributed
from tests.equivalence import (
    RunRecord,
    assert_equivalent,
    reference_training,
    run_steps,
    tiny_config,
    tiny_data,
)


def tied_gpt(cfg: RunConfig) -> GPT:
    torch.manual_seed(cfg.train.seed)
    return GPT(dataclasses.replace(run_gpt_config(cfg), tie_embeddings=True))


def layout(dp=1, pp=1, tp=1, zero=0, sp=False, schedule="1f1b") -> RunConfig:
    cfg = tiny_config(micro_batch=2)
    p = cfg.parallel
    p.dp, p.pp, p.tp, p.zero, p.sequence_parallel, p.schedule = dp, pp, tp, zero, sp, schedule
    cfg.train.microbatches = cfg.train.global_batch // (cfg.train.micro_batch * dp)
    return cfg


def train_tied(rank, world_size, configs, data) -> list[RunRecord]:
    """Each layout trained with the one step (train/step.py) from the same tied model."""
    records = []
    for cfg in configs:
        p = cfg.parallel
        mesh = Mesh.build(dp=p.dp, pp=p.pp, tp=p.tp)
        engine = build_engine(cfg, mesh, model=tied_gpt(cfg))
        losses, norms = run_steps(engine, cfg, data, mesh.group("dp"))
        engine.finish()
        state = {}
        for module in engine.modules:
            state.update(full_state_dict(module, mesh.group("tp")))
        records.append(RunRecord(losses, norms, state))
        mesh.close()
    return records


CASES = {
    2: [layout(dp=2), layout(dp=2, zero=1), layout(dp=2, zero=2), layout(dp=2, zero=3),
        layout(tp=2), layout(tp=2, sp=True), layout(pp=2), layout(pp=2, schedule="zb-h1")],
    4: [layout(dp=2, pp=2, zero=1), layout(dp=2, pp=2, zero=2), layout(dp=2, tp=2, zero=3),
        layout(pp=2, tp=2)],
}  # fmt: skip


@pytest.mark.parametrize("world", sorted(CASES))
def test_tied_weights_train_equal_to_one_process(world):
    data = tiny_data()
    configs = CASES[world]
    reference, initial = reference_training(configs[0], data, tie_embeddings=True)
    assert torch.equal(initial["head.weight"], initial["tok_emb.weight"])
    per_rank = run_distributed(train_tied, world, configs, data)
    for i, cfg in enumerate(configs):
        p = cfg.parallel
        name = f"dp {p.dp} pp {p.pp} tp {p.tp} zero {p.zero} sp {p.sequence_parallel}"
        state: dict[str, torch.Tensor] = {}
        for records in per_rank:
            state.update(records[i].state)
            assert records[i].losses == per_rank[0][i].losses, name
        record = RunRecord(per_rank[0][i].losses, per_rank[0][i].grad_norms, state)
        try:
            assert_equivalent(record, reference, initial)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
        # Both names of the one parameter end equal (the pipeline's two copies too).
        assert torch.equal(state["head.weight"], state["tok_emb.weight"]), name


def full_states(rank, world_size) -> list[dict[str, torch.Tensor]]:
    cfg = tiny_config()
    mesh = Mesh.build(dp=world_size)
    out = []
    for zero in (0, 1, 2, 3):
        cfg.parallel.zero = zero
        replica = data_parallel(tied_gpt(cfg), mesh.group("dp"), cfg)
        out.append(replica.full_state_dict())
    return out


def test_every_wrappers_full_state_dict_loads_strictly_with_the_alias():
    cfg = tiny_config()
    plain = tied_gpt(cfg)
    expected = plain.state_dict()
    assert "head.weight" in expected and "tok_emb.weight" in expected
    for zero, state in enumerate(run_distributed(full_states, 2)[1]):
        assert state.keys() == expected.keys(), zero
        fresh = tied_gpt(cfg)
        torch.nn.init.zeros_(fresh.tok_emb.weight)
        fresh.load_state_dict(state, strict=True)
        for name, value in expected.items():
            assert torch.equal(fresh.state_dict()[name], value), (zero, name)


def split_tie_apart(rank, world_size) -> str:
    from paratrain.models.plans import GPT_TP_PLAN
    from paratrain.parallel.tensor_parallel import apply_tensor_parallel

    plan = dict(GPT_TP_PLAN, head="rowwise", loss_fn="replicated")  # head split by columns
    try:
        apply_tensor_parallel(tied_gpt(tiny_config()), plan, Mesh.build(tp=2).group("tp"))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_plan_that_splits_a_tie_apart_is_refused():
    for message in run_distributed(split_tie_apart, 2):
        assert "splits the tied parameter tok_emb.weight and head.weight differently" in message
