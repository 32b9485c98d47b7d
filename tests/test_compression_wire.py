"""--compress and DiLoCo's outer steps on the wire: the bytes the kernel's TCP counters
show delivered (measure/tcp_bytes.py), not only the ledger's count (tests/
test_compression_training.py, test_low_precision.py). One step's bytes are the difference
between a run of 3 steps and one of 1, so set-up and the end of the run cancel out."""

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


def test_diloco_int8_and_fp4_outer_steps_on_the_wire():
    """DiLoCo with H 1 in 2 groups of one rank: every step is an outer step, and what it
    delivers on the wire is the ledger's bytes plus gloo's preambles; int8 outer gradients
    about 3.9 and fp4 about 7.8 times fewer bytes than float32's (at least 3.5 and 6.5 with
    the preambles and the scalars every step also sends)."""
    sent = {}
    for dtype in ("float32", "int8", "fp4"):
        cfg = config(dp=2, zero=1, replicas=2, dp_mode="diloco", sync_every=1)
        cfg.parallel.outer_dtype, cfg.train.val_batches = dtype, 0
        sent[dtype] = run_distributed(per_step_on_the_wire, 2, cfg, order="gloo")
    for rank in range(2):
        (plain, _), (int8, ledger8), (fp4, ledger4) = (sent[d][rank] for d in sent)
        print(f"per step on the wire: float32 {plain:,.0f}, int8 {int8:,.0f}, fp4 {fp4:,.0f}")
        assert 0 <= int8 - ledger8 <= PREAMBLES_MAX and 0 <= fp4 - ledger4 <= PREAMBLES_MAX
        assert plain / int8 >= 3.5 and plain / fp4 >= 6.5, (plain, int8, fp4)
