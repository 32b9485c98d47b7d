"""`paratrain bench cp`: context-parallel attention (ring and all-to-all, 2 ranks) against
single-process attention of the same sequence: time, bytes (ledger and formula), memory.

    run.py      flags to a run: the ranks, the checks, the report
    compare.py  what each rank runs: its shard through ours, the whole sequence through SDPA
"""
