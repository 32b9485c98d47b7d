"""Moonlight's bound on the wire (issue 35): under ZeRO-1, Muon's traffic per step is within
1.25 times AdamW's in the bytes the kernel's TCP counters show delivered
(measure/tcp_bytes.py), not only in the ledger's count (test_muon.py). One step's bytes
are the difference between a run of 3 steps and one of 1, so set-up and the end of the
run cancel out. And what Muon adds on the wire is what the ledger records of its two
all-to-alls (the pieces to their owners, the results back), plus gloo's preambles.
"""

from __future__ import annotations

from tests.distributed import run_distributed
from tests.test_prediction import config
from tests.test_wire import PREAMBLES_MAX, per_step_on_the_wire


def test_muon_under_zero_1_sends_at_most_a_quarter_more_than_adamw_on_the_wire():
    sent = {}
    for optimizer in ("adamw", "muon"):
        cfg = config(dp=2, zero=1)
        cfg.train.optimizer, cfg.train.val_batches = optimizer, 0
        sent[optimizer] = run_distributed(per_step_on_the_wire, 2, cfg, "all_to_all", order="gloo")
    for (adamw, none), (muon, exchanged) in zip(sent["adamw"], sent["muon"], strict=True):
        print(f"per step on the wire: AdamW {adamw:,.0f}, Muon {muon:,.0f} bytes; "
              f"Muon's all-to-alls {exchanged:,.0f} in the ledger")  # fmt: skip
        assert none == 0 and exchanged > 0
        assert 0 <= muon - adamw - exchanged <= PREAMBLES_MAX, (adamw, muon, exchanged)
        assert muon <= 1.25 * adamw, (adamw, muon)
