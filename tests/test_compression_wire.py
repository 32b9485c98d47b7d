"""--compress on the wire: the bytes the kernel's TCP counters show delivered
(measure/tcp_bytes.py), not only the ledger's count (tests/test_compression_training.py).
One step's bytes are the difference between a run of 3 steps and one of 1, so set-up and
the end of the run cancel out."""

from __future__ import annotations

from tests.distributed import run_distributed
from tests.test_prediction import config
from tests.test_wire import PREAMBLES_MAX, per_step_on_the_wire


def test_int8_with_error_feedback_sends_a_quarter_of_the_bytes_on_the_wire():
    """2 ranks of data parallelism: with --compress int8 each step delivers what the ledger
    records (the encoded chunks' all-to-all, the owners' means' all-gather, the scalars)
    plus gloo's preambles, and about 3.9 times fewer bytes than float32's all-reduce (at
    least 3.5 with the preambles of its extra calls)."""
    sent = {}
    for method in ("none", "int8"):
        cfg = config(dp=2)
        cfg.parallel.compress, cfg.train.val_batches = method, 0
        sent[method] = run_distributed(per_step_on_the_wire, 2, cfg, order="gloo")
    for (plain, _), (ours, ledger) in zip(sent["none"], sent["int8"], strict=True):
        print(f"per step on the wire: float32 {plain:,.0f}, int8 {ours:,.0f} bytes; "
              f"int8's ledger {ledger:,.0f}")  # fmt: skip
        assert 0 <= ours - ledger <= PREAMBLES_MAX, (ours, ledger)
        assert plain / ours >= 3.5, (plain, ours)
