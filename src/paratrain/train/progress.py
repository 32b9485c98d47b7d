"""What rank 0 shows while training: a live tqdm bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from paratrain.train.metrics import StepMetrics

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_steps: int, log_every: int, enabled: bool) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.total = total_steps
        live = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True) if live else None

    def update(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        # --compile: the seconds a step spent compiling, apart from its tok/s
        compiled = f"  compile {m.compile_s:.1f} s" if m.compile_s else ""
        if self.bar is not None:
            more = {"compile_s": f"{m.compile_s:.1f}"} if m.compile_s else {}
            self.bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens_per_s:,.0f}", **more)
            self.bar.update(1)
        elif m.step % self.log_every == 0 or m.step in (1, self.total) or compiled:
            log.info(
                "step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  grad_norm %.3f%s",
                m.step,
                self.total,
                m.loss,
                m.lr,
                m.tokens_per_s,
                m.grad_norm,
                compiled,
            )
            if m.routing is not None:  # a mixture of experts: how its routing went
                r = m.routing
                log.info(
                    "  experts: tokens per expert %d..%d  dropped %.1f%%  aux loss %.4f",
                    r["expert_tokens_min"],
                    r["expert_tokens_max"],
                    100 * r["dropped_fraction"],
                    r["aux_loss"],
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
