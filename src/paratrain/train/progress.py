"""What rank 0 shows while training: one live bar on a terminal, a log line every
--log-every steps otherwise.

The bar is tqdm's, sized from the terminal at every step, so it follows a resized window
(a pseudo-terminal may report 0 rows and 0 columns, as `script` under a pipe does; tqdm's
own dynamic_ncols would then draw nothing, so 0 falls back to 80 x 24). While it is live,
rank 0's log lines go through `tqdm.write`, which clears the bar, prints the line and
draws the bar again, so a checkpoint's line never splits it.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from paratrain.train.metrics import StepMetrics

log = logging.getLogger(__name__)

BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining} ETA{postfix}"


def terminal_size(stream: TextIO) -> tuple[int, int]:
    """(columns, rows) of the terminal behind `stream`; 80 x 24 where it reports zeros."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):
        return 80, 24
    return size.columns or 80, size.lines or 24


class Progress:
    def __init__(
        self,
        total_steps: int,
        log_every: int,
        enabled: bool,
        first_step: int = 0,
        stream: TextIO | None = None,
        bar: bool = True,
    ) -> None:
        """first_step: the steps already done (a resumed run's checkpoint step); bar: False
        for log lines even on a terminal (processes that share one: fault tolerance's)."""
        self.enabled = enabled
        self.log_every = log_every
        self.total = total_steps
        self.first = first_step + 1
        stream = stream or sys.stderr
        self.stream = stream
        self.bar: tqdm | None = None
        self._redirect = ExitStack()
        if enabled and bar and stream.isatty():
            columns, rows = terminal_size(stream)
            self.bar = tqdm(
                total=total_steps,
                initial=first_step,
                file=stream,
                ncols=columns,
                nrows=rows,
                bar_format=BAR_FORMAT,
                smoothing=0.1,  # the ETA follows recent steps, not the slow first one
            )
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))

    def update(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self._show(m)
        elif m.step % self.log_every == 0 or m.step in (self.first, self.total) or m.compile_s:
            self._log(m)

    def _show(self, m: StepMetrics) -> None:
        assert self.bar is not None
        more = {"compile_s": f"{m.compile_s:.1f}"} if m.compile_s else {}
        # the window may have been resized since the last step: draw at its size now
        self.bar.ncols, self.bar.nrows = terminal_size(self.stream)
        # update's redraw waits out tqdm's mininterval; set_postfix's, after it, does not:
        # every step is shown, however fast the steps before it came
        self.bar.update(m.step - self.bar.n)  # the global step, also after a resume
        self.bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens_per_s:,.0f}", **more)

    def _log(self, m: StepMetrics) -> None:
        # --compile: the seconds a step spent compiling, apart from its tok/s
        compiled = f"  compile {m.compile_s:.1f} s" if m.compile_s else ""
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
            self._redirect.close()
            self.bar.close()
            self.bar = None
