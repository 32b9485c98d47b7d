"""Moonlight's bound on the wire (issue 35): under ZeRO-1, Muon's traffic per step is within
1.25 times AdamW's in the bytes the kernel's TCP counters show delivered
(measure/tcp_bytes.py), not only in the ledger's count (test_muon.py). One step's bytes
are the difference between a run of 3 steps and one of 1, so set-up and the end of the
run cancel out. And what Muon adds on the wire is what the ledger records of its two
all-to-alls (the pieces to their owners, the results back), plus gloo's preambles.
"""

from __future__ import annotations

import dataclasses

from paratrain.comm.group import CommOptions
from paratrain.measure import tcp_bytes as wire
from paratrain.mesh import Mesh
from tests.distributed import run_distributed
from tests.equivalence import tiny_data
from tests.test_prediction import config
from tests.test_wire import PREAMBLES_MAX


def _per_step(rank: int, world: int, cfg) -> tuple[float, float]:
    """(bytes delivered on the wire, the ledger's all-to-all bytes) per step, this rank."""
    from paratrain.train.loop import train

    mesh = Mesh.build(dp=world, options=CommOptions(order=cfg.parallel.comm_order))
    acked, all_to_all = [], []
    for steps in (1, 3):
        run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        mesh.ledger.reset()
        with wire.WireMeter() as meter:  # a FileStore: no store socket to leave out
            train(run, mesh, tiny_data())
        acked.append(meter.acked)
        all_to_all.append(mesh.ledger.bytes_sent(op="all_to_all"))
    mesh.close()
    return (acked[1] - acked[0]) / 2, (all_to_all[1] - all_to_all[0]) / 2


def test_muon_under_zero_1_sends_at_most_a_quarter_more_than_adamw_on_the_wire():
    sent = {}
    for optimizer in ("adamw", "muon"):
        cfg = config(dp=2, zero=1)
        cfg.train.optimizer, cfg.train.val_batches = optimizer, 0
        sent[optimizer] = run_distributed(_per_step, 2, cfg, order="gloo")
    for (adamw, none), (muon, exchanged) in zip(sent["adamw"], sent["muon"], strict=True):
        print(f"per step on the wire: AdamW {adamw:,.0f}, Muon {muon:,.0f} bytes; "
              f"Muon's all-to-alls {exchanged:,.0f} in the ledger")  # fmt: skip
        assert none == 0 and exchanged > 0
        assert 0 <= muon - adamw - exchanged <= PREAMBLES_MAX, (adamw, muon, exchanged)
        assert muon <= 1.25 * adamw, (adamw, muon)
