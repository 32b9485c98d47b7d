"""Rules on a mixture of experts and --ep (the ranges of each flag are their fields' facts);
each failure is one line naming the flag and what would be valid.

What is refused, and why (docs/experts.md, "Not done yet"):
- sequence parallelism: each tp rank would route only its slice of the sequence;
- asynchronous data parallelism: no batch spans the workers;
- context parallelism: capacity queues tokens in the batch's order, each shard a
  contiguous run of it (GroupBatch); cp's load-balanced chunks are not, so with drops
  other tokens would be dropped than one process drops;
- --compile: the experts' token counts decide shapes (a graph break each), and no test
  trains it yet;
- with ep > 1: fp16 (each of the two wrappers would scale the loss).
"""

from __future__ import annotations

from paratrain.config import RunConfig


def experts_rules(cfg: RunConfig) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not m.num_experts:
        if p.ep > 1:
            raise ValueError(
                f"--ep {p.ep} splits the experts of a mixture of experts, and this model is "
                "dense: give --num-experts (or --model moe-tiny), or use --ep 1"
            )
        return
    _check_routing(cfg)
    refused = {
        "--sequence-parallel": p.sequence_parallel,
        "--dp-mode async": p.dp_mode == "async",
        f"--cp {p.cp}": p.cp > 1,
        "--compile": t.compile,
    }
    for what, present in refused.items():
        if present:
            raise ValueError(
                f"{what} with a mixture of experts (--num-experts {m.num_experts}) is not "
                "supported yet (docs/experts.md); drop one of them"
            )
    _check_expert_parallel(cfg)


def _check_routing(cfg: RunConfig) -> None:
    m = cfg.model
    if m.top_k > m.num_experts:
        raise ValueError(f"--top-k {m.top_k} must be between 1 and --num-experts {m.num_experts}")
    if m.arch == "gpt" and m.activation != "gelu":
        raise ValueError(
            f"--activation {m.activation} with a mixture of experts: the experts use the exact "
            "gelu; use --activation gelu"
        )


def _check_expert_parallel(cfg: RunConfig) -> None:
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    if p.dp % p.ep:
        raise ValueError(
            f"--ep {p.ep} must divide the data-parallel degree dp = {p.dp} (experts are split "
            f"over ep of the dp ranks); use a divisor of {p.dp}"
        )
    if m.num_experts % p.ep:
        raise ValueError(
            f"--ep {p.ep} must divide --num-experts {m.num_experts} (each rank of an ep "
            f"group holds an equal share of the experts); use a divisor of {m.num_experts}"
        )
    if cfg.train.dtype == "float16":
        raise ValueError(
            f"--ep {p.ep} with --dtype float16 is not supported yet (the two wrappers would "
            "each scale the loss); use --dtype bfloat16 or float32"
        )
