"""`paratrain bench moe`: expert dispatch and combine (parallel/expert_parallel) at 2 ranks
against tokens per rank: time, bytes (ledger and formula), the round trip checked exact.

    run.py      the sweep, the checks, the report
    compare.py  what each rank runs
"""
