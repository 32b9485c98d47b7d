"""--compress on the wire: the bytes the kernel's TCP counters show delivered
(measure/tcp_bytes.py), not only the ledger's count (tests/test_compression_training.py).
One step's bytes are the difference between a run of 3 steps and one of 1, so set-up and
the end of the run cancel out."""

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
    """(bytes delivered on the wire, bytes in the ledger) per step, this rank."""
    from paratrain.train.loop import train

    mesh = Mesh.build(dp=world, options=CommOptions(order=cfg.parallel.comm_order))
    acked, ledger = [], []
    for steps in (1, 3):
        run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        mesh.ledger.reset()
        with wire.WireMeter() as meter:  # a FileStore: no store socket to leave out
            train(run, mesh, tiny_data())
        acked.append(meter.acked)
        ledger.append(mesh.ledger.bytes_sent())
    mesh.close()
    return (acked[1] - acked[0]) / 2, (ledger[1] - ledger[0]) / 2


def test_int8_with_error_feedback_sends_a_quarter_of_the_bytes_on_the_wire():
    """2 ranks of data parallelism: with --compress int8 each step delivers what the ledger
    records (the encoded chunks' all-to-all, the owners' means' all-gather, the scalars)
    plus gloo's preambles, and about 3.9 times fewer bytes than float32's all-reduce (at
    least 3.5 with the preambles of its extra calls)."""
    sent = {}
    for method in ("none", "int8"):
        cfg = config(dp=2)
        cfg.parallel.compress, cfg.train.val_batches = method, 0
        sent[method] = run_distributed(_per_step, 2, cfg, order="gloo")
    for (plain, _), (ours, ledger) in zip(sent["none"], sent["int8"], strict=True):
        print(f"per step on the wire: float32 {plain:,.0f}, int8 {ours:,.0f} bytes; "
              f"int8's ledger {ledger:,.0f}")  # fmt: skip
        assert 0 <= ours - ledger <= PREAMBLES_MAX, (ours, ledger)
        assert plain / ours >= 3.5, (plain, ours)
