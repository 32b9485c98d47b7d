"""What the benchmarks share. Their ranks are started by `paratrain.spawn` (src/paratrain/
spawn.py), the spawner the multi-process tests use too.

    sides.py       the two sides of a comparison: our engine and `train_step` (OurSide);
                   the peer's plain-PyTorch step (torch_step) with torch's global-norm clip
    pairs.py       alternating timed pairs, the ratio's median and spread, the loss check
    ddp_pairs.py   ours against a DDP peer with the optimizer a bench gives it (dp, muon)
    machine.py     the machine line every bench prints
    bytes_sent.py  bytes per op on both sides: ours from the ledger, a peer's counted at
                   the dispatcher and sized with our ledger's formulas

A bench's rank function builds one `OurSide` and one peer step, hands both to
`time_pairs`, and returns the rows; the parent checks the losses and summarises the times.
"""
