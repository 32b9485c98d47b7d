"""Tensor parallelism (Megatron-LM), applied from outside by a plan of module-name patterns.

    apply_tensor_parallel(model, plan.tensor_parallel, mesh.group("tp"), sequence_parallel=True)

apply.py: the plan's styles and `apply_tensor_parallel`; layers.py: the column-, row- and
vocabulary-parallel layers sliced from full ones; loss.py: cross-entropy over logits split
by vocabulary; rng.py: dropout masks the same or different per rank, by region; state.py:
which parameters are split, their partial gradients under sequence parallelism, and the
whole weights gathered back. The differentiable collectives (f, g) are comm/regions.py.
Imports `comm` and `config` only (test_layering.py).
"""

from paratrain.parallel.tensor_parallel.apply import (
    STYLES,
    ColumnParallelLinear,
    RngTracker,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    full_state_dict,
    match_plan,
    sequence_parallel_parameters,
    sharded_parameters,
)

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "RngTracker",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "full_state_dict",
    "match_plan",
    "sequence_parallel_parameters",
    "sharded_parameters",
]
