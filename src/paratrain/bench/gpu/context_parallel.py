"""`python -m paratrain.bench.gpu.context_parallel`: PyTorch's own context-parallel
attention (`torch.distributed.tensor.experimental.context_parallel`, CUDA attention kernels
only) at 2 GPUs against one GPU's attention of the same sequence: `paratrain bench cp`'s
peer for a machine with several GPUs, where the CPU bench cannot run it.

One attention layer (q, k, v projections of an input x, causal SDPA, bf16) as a model would
run it: x and the upstream gradient w are the buffers torch shards along the sequence
(load-balanced, its default for causal masks); the projections' weights are whole on
both ranks. Checked: the unsharded output against one GPU's, and the projections'
gradients summed over the 2 ranks against one GPU's (bf16 tolerance). Timed: forward and
backward, CUDA events, alternating pairs (harness/pairs.py), ratio 2-GPU / 1-GPU step.
With fewer than 2 CUDA GPUs it prints why it skips and exits 0: nothing to compare.
Not run in this project yet (its machine has one GPU); the CPU bench is `bench cp`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from paratrain.bench.harness.pairs import ratio_summary, time_pairs
from paratrain.comm import compat
from paratrain.spawn import run_ranks

WORLD = 2
TOLERANCE = 2e-2  # bf16, relative to the largest magnitude


def _weights(d_model: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    return [
        (torch.randn(d_model, d_model, generator=g) / d_model**0.5)
        .to(device, torch.bfloat16)
        .requires_grad_()
        for _ in range(3)
    ]


def _attention(x: torch.Tensor, w: torch.Tensor, weights: list[torch.Tensor], heads: int):  # noqa: ANN202
    b, s, d = x.shape
    q, k, v = ((x @ m).view(b, s, heads, d // heads).transpose(1, 2) for m in weights)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, d/h)
    out = out.transpose(1, 2).reshape(b, s, d)
    (out.float() * w).sum().backward()
    return out.detach()


def _rank(rank: int, world: int, shape: dict[str, int], pairs: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    b, s, d, heads = shape["batch"], shape["seq"], shape["d_model"], shape["heads"]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(b, s, d, generator=g).to(device, torch.bfloat16)
    w = torch.randn(b, s, d, generator=g).to(device)
    single, torch_cp = _weights(d, device), _weights(d, device)
    want = _attention(x, w, single, heads)

    def cp_step() -> torch.Tensor:
        xs, ws = x.clone(), w.clone()  # torch shards its buffers in place
        with context_parallel(mesh, buffers=[xs, ws], buffer_seq_dims=[1, 1]):
            out = _attention(xs, ws, torch_cp, heads)
        return compat.context_parallel_unshard()(mesh, [out], [1])[0]

    got = cp_step()
    grads = [_grad(m).float() for m in torch_cp]
    for grad in grads:
        torch.distributed.all_reduce(grad)  # each rank's gradient is its tokens' part
    errors = [_relative(got.float(), want.float())]
    errors += [_relative(g, _grad(m).float()) for g, m in zip(grads, single, strict=True)]

    def timed(step: Any) -> Any:
        def run(_batch: Any) -> float:
            step()
            torch.cuda.synchronize(device)
            return 0.0

        return run

    rows = time_pairs(
        timed(cp_step),
        timed(lambda: _attention(x, w, single, heads)),
        [[]] * pairs,
        sync=lambda: torch.distributed.barrier(),
    )
    return {"errors": errors, "rows": [(r.ours_s, r.peer_s) for r in rows]}


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "every weight takes part in the step"
    return p.grad


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pairs", type=int, default=10)
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < WORLD:
        print(f"skipped: torch's context parallel needs {WORLD} CUDA GPUs, found {gpus}")
        return 0
    shape = {"batch": args.batch, "seq": args.seq_len, "d_model": args.d_model, "heads": args.heads}
    per_rank = run_ranks(_rank, WORLD, shape, args.pairs, backend="nccl", timeout=1800)
    worst = max(max(r["errors"]) for r in per_rank)
    steps = range(len(per_rank[0]["rows"]))
    summary = ratio_summary(
        [max(r["rows"][i][0] for r in per_rank) for i in steps],
        [max(r["rows"][i][1] for r in per_rank) for i in steps],
    )
    result = {"shape": shape, "max_relative_error": worst, **summary}
    print(
        f"torch context_parallel at {WORLD} GPUs {summary['ours_step_s']:.4f} s, one GPU "
        f"{summary['torch_step_s']:.4f} s, ratio {summary['ratio']:.3f} "
        f"(IQR {summary['ratio_q1']:.3f}-{summary['ratio_q3']:.3f}); max relative error {worst:.1e}"
    )
    print(json.dumps(result))
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
