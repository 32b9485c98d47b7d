"""Memory per GPU: model states itemised (ZeRO's accounting) and activations.

Model states (ZeRO, arXiv:1910.02054, section 3.1; seeds, definition 9.2.3): with
mixed-precision Adam each parameter costs 2 bytes of weights, 2 of gradient, 4 + 4 of
moments and 4 of fp32 master weights, 16N in all. Tensor and pipeline parallelism divide
N among tp * pp GPUs; ZeRO then shards over the dp group of k GPUs:

    stage:      params   grads   optimizer + master
    0 (DP)        1        1           1
    1             1        1          1/k
    2             1       1/k         1/k
    3 (FSDP)     1/k      1/k         1/k

A sharded flat buffer is padded to a multiple of k, so a shard is ceil(n / k) elements.

ZeRO-2 with accumulate "shard" (the default, the runtime's and DeepSpeed's) reduce-scatters
gradients into the shard after every micro-batch (K-fold traffic, comm.py), so its model
state is the table's row, 2N + 14N/k with mixed-precision Adam (the seeds, ZeRO's
figure 1). With K > 1 micro-batches and accumulate "full" it also holds the whole
gradient, n x grad bytes, from the first micro-batch's backward until the one reduce-scatter
after the last (parallel/data_parallel/zero.py): `grad_accumulation`, a transient item
counted in the total (it is alive at the peak, during the last backward) but not at the step
boundary. Beside the ceil(n / k) shard it makes the peak exceed ZeRO-1's by that shard. With
"shard", and for K = 1, the item is 0.

Activations: plan/activations.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.plan.layout import Layout, Workload


@dataclass(frozen=True)
class ModelState:
    """Model-state bytes on one GPU, by kind (the seeds' table 9.2.3 columns), and the
    transient whole gradient of ZeRO-2's "full" accumulation (module docstring)."""

    params: int
    grads: int
    optimizer: int  # all moments (Adam: m and v)
    master: int  # fp32 master weights
    grad_accumulation: int = 0  # transient: alive during the step, gone at its boundary

    @property
    def total(self) -> int:
        """The peak: the step-boundary items plus the transient one."""
        return self.params + self.grads + self.grad_accumulation + self.optimizer + self.master

    @property
    def step_boundary(self) -> int:
        """What is held between steps (the seeds' totals, the runtime's record)."""
        return self.total - self.grad_accumulation

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "grad_accumulation": self.grad_accumulation,
            "optimizer": self.optimizer,
            "master": self.master,
            "total": self.total,
        }


def local_params(n_params: int, tp: int, pp: int) -> int:
    """Parameters held by one GPU before ZeRO: N / (tp * pp), rounded up.

    An approximation for real models (LayerNorms are replicated across tp, embeddings and
    head sit on the end stages); exact when tp = pp = 1.
    """
    return math.ceil(n_params / (tp * pp))


def holds_whole_gradient(workload: Workload, layout: Layout, microbatches: int) -> bool:
    """True for ZeRO-2 accumulating the whole gradient over K > 1 micro-batches."""
    full = workload.zero2_accumulate == "full"
    return layout.zero == 2 and layout.shard_ranks > 1 and full and microbatches > 1


def model_state_bytes(
    n_params: int, workload: Workload, layout: Layout, microbatches: int = 1
) -> ModelState:
    """Bytes of parameters, gradients, optimizer moments and master weights on one GPU,
    and ZeRO-2's transient whole gradient when it accumulates K = `microbatches` > 1.
    ZeRO shards over the dp_cp group (the cp ranks hold the same parameters), under HSDP
    over one replica group of it (`Layout.shard_ranks`)."""
    n = local_params(n_params, layout.tp, layout.pp)
    shard = math.ceil(n / layout.shard_ranks)  # elements of one ZeRO shard
    p = workload.precision
    z = layout.zero
    whole = holds_whole_gradient(workload, layout, microbatches)
    return ModelState(
        params=p.param_bytes * (shard if z >= 3 else n),
        grads=p.grad_bytes * (shard if z >= 2 else n),
        optimizer=workload.moments * p.moment_bytes * (shard if z >= 1 else n),
        master=p.master_bytes * (shard if z >= 1 else n),
        grad_accumulation=p.grad_bytes * n if whole else 0,
    )


def redundant_bytes(
    n_params: int, workload: Workload, layout: Layout, state: ModelState | None = None
) -> int:
    """Model-state bytes held more than once across the job: (k - 1) * 16N for plain DP.
    `state`: one GPU's, when it is not `model_state_bytes`'s (a mixture of experts')."""
    per_gpu = (state or model_state_bytes(n_params, workload, layout)).step_boundary
    return max(0, layout.world * per_gpu - workload.state_bytes_per_param * n_params)
