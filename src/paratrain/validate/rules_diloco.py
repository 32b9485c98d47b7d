"""Rules on --dp-mode diloco (parallel/diloco.py): replica groups to train apart, and what
it does not combine with yet."""

from __future__ import annotations

from paratrain.config import RunConfig


def diloco_rules(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.dp_mode != "diloco":
        return
    if p.replicas < 2:
        raise ValueError(
            "--dp-mode diloco trains replica groups apart: give --replicas 2 or more "
            "(dividing the data-parallel ranks)"
        )
    if p.fault_tolerance:  # plain DiLoCo only (fault_tolerance/outer_rounds.py)
        plain = [
            (p.fragments > 1, f"--fragments {p.fragments}", "--fragments 1"),
            (p.sync_delay > 0, f"--sync-delay {p.sync_delay}", "--sync-delay 0"),
            (p.merge_alpha > 0, f"--merge-alpha {p.merge_alpha}", "--merge-alpha 0"),
            (p.outer_dtype != "float32", f"--outer-dtype {p.outer_dtype}", "float32"),
            # an inner round has no collective across the groups for a hang to hold
            ("hang:" in p.inject_fault, "--inject-fault hang", "kill or allreduce-error"),
        ]
        for refused, given, instead in plain:
            if refused:
                raise ValueError(
                    f"--dp-mode diloco --fault-tolerance with {given} is not supported yet; "
                    f"use {instead}"
                )
    if p.fragments > cfg.model.n_layer:
        raise ValueError(
            f"--fragments {p.fragments} is more than the model's {cfg.model.n_layer} blocks; "
            f"valid: 1 to {cfg.model.n_layer}"
        )
    if p.sync_delay >= p.sync_every:
        raise ValueError(
            f"--sync-delay {p.sync_delay} with --sync-every {p.sync_every}: an outer step "
            "would start before the last one landed; valid: 0 to "
            f"{p.sync_every - 1}"
        )
    streaming = [
        (p.fragments > 1, f"--fragments {p.fragments}"),
        (p.sync_delay > 0, f"--sync-delay {p.sync_delay}"),
        (p.merge_alpha > 0, f"--merge-alpha {p.merge_alpha}"),
    ]
    chosen = [flag for on, flag in streaming if on]
    every = cfg.train.checkpoint_every
    if chosen and every:
        raise ValueError(
            f"{chosen[0]} with --checkpoint-every {every}: a streaming run's groups hold one "
            "model only after its last step, which it saves; use --checkpoint-every 0"
        )
