"""Rules on splitting layers and sequences: tensor parallelism (and its sequence
parallelism), context parallelism, ZeRO. The model's own divisibility facts are
models/plans.py's (check_tensor_parallel, check_context_parallel)."""

from __future__ import annotations

from paratrain.config import RunConfig
from paratrain.models.plans import check_context_parallel, check_tensor_parallel


def tensor_parallel_rules(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.tp == 1:
        if p.sequence_parallel:
            raise ValueError("--sequence-parallel needs tensor parallelism (--tp 2 or more)")
        return
    if p.dp_mode == "async":
        raise ValueError("--dp-mode async does not combine with tensor parallelism; use --tp 1")
    if p.sequence_parallel and p.pp > 1:
        raise ValueError(
            "--sequence-parallel with a pipeline (--pp > 1) is not supported yet: stages "
            "exchange whole sequences; drop one of them"
        )
    check_tensor_parallel(cfg.model, p.tp, cfg.train.seq_len, p.sequence_parallel)


def context_parallel_rules(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    if p.dp_mode == "async":
        raise ValueError(
            f"--cp {p.cp} with --dp-mode async: the server holds no sequence; use --cp 1"
        )
    if m.dropout > 0:
        raise ValueError(
            f"--cp {p.cp} with --dropout {m.dropout}: ring and all-to-all attention have "
            "no attention dropout; use --dropout 0 or --cp 1"
        )
    check_context_parallel(m, p.cp, p.cp_method, p.tp, cfg.train.seq_len, p.sequence_parallel)


def zero_rules(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    sharded = p.zero > 0 or t.dtype != "float32"
    if sharded and p.dp_mode == "async":
        raise ValueError("--dp-mode async keeps the whole model on the server; use --zero 0")
    if p.zero == 3 and p.pp > 1:
        raise ValueError(
            "--zero 3 with a pipeline (--pp > 1) is refused: every micro-batch would gather "
            "the stage's parameters again (DeepSpeed forbids it too); use --zero 1 or 2"
        )


def hsdp_rules(cfg: RunConfig) -> None:
    """--replicas R (HSDP): ZeRO within each of R replica groups of the dp ranks."""
    p = cfg.parallel
    if p.replicas == 1:
        return
    if p.zero == 0 and p.dp_mode != "diloco":  # also EFFECTS'; for configurations in code
        raise ValueError(
            f"--replicas {p.replicas} needs ZeRO (--zero 1, 2 or 3): without sharding every "
            "dp rank holds the whole model, so replica groups would be plain data parallelism; "
            "use --replicas 1"
        )
    if p.dp % p.replicas:
        divisors = [r for r in range(1, p.dp + 1) if p.dp % r == 0]
        raise ValueError(
            f"--replicas {p.replicas} does not divide the {p.dp} data-parallel ranks; "
            f"valid: {', '.join(map(str, divisors))}"
        )
    group = p.dp * p.cp // p.replicas
    if group % p.ep:  # every replica group must hold every expert (mesh_shape.py)
        eps = [e for e in range(1, group + 1) if group % e == 0]
        raise ValueError(
            f"--ep {p.ep} does not divide a replica group's {group} ranks (dp x cp / "
            f"--replicas {p.replicas}), so a group would lack experts; valid: "
            f"{', '.join(map(str, eps))}"
        )
