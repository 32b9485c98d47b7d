"""The settings several fields need before they change anything, as `Effect`s (each field's
own condition sits in its `param`). Read on the resolved configuration: a RunConfig."""

from __future__ import annotations

from typing import Any

from paratrain.config.fields import Effect


def world(cfg: Any) -> int:
    p = cfg.parallel
    return p.dp * p.pp * p.cp * p.tp


SYNC = Effect(lambda c: c.parallel.dp_mode != "async", "--dp-mode sync or diloco")
ASYNC = Effect(lambda c: c.parallel.dp_mode == "async", "--dp-mode async")
DILOCO = Effect(lambda c: c.parallel.dp_mode == "diloco", "--dp-mode diloco")
LLAMA = Effect(lambda c: c.model.arch == "llama", "a Llama model (--arch llama)")
GPT = Effect(lambda c: c.model.arch == "gpt", "a GPT model (--arch gpt)")
MOE = Effect(lambda c: c.model.num_experts > 0, "a mixture of experts (--num-experts)")
PIPELINE = Effect(lambda c: c.parallel.pp > 1, "a pipeline (--pp 2 or more)")
LORA = Effect(lambda c: c.train.lora_rank > 0, "LoRA (--lora-rank 1 or more)")
MUON = Effect(lambda c: c.train.optimizer == "muon", "--optimizer muon")
ADAMW = Effect(lambda c: c.train.optimizer != "sgd", "--optimizer adamw or muon (AdamW's)")
COLLECTIVES = Effect(lambda c: world(c) > 1, "more than one process")
DC_ASGD = Effect(
    lambda c: c.parallel.dp_mode == "async" and c.parallel.dc_lambda > 0,
    "--dp-mode async with --dc-lambda above 0",
)
FAULT_GROUPS = Effect(
    lambda c: c.parallel.replicas > 1, "HSDP replica groups (--replicas 2 or more)"
)
FAULT_TOLERANCE = Effect(
    lambda c: c.parallel.replicas > 1 and c.parallel.fault_tolerance,
    "--fault-tolerance with --replicas 2 or more",
)
COMPRESSING = Effect(
    lambda c: c.parallel.compress != "none" and c.parallel.dp > 1,
    "--compress powersgd, int8 or sign with dp 2 or more",
)
POWERSGD = Effect(
    lambda c: c.parallel.compress == "powersgd" and c.parallel.dp > 1,
    "--compress powersgd with dp 2 or more",
)
