"""`paratrain plan --validate`: the planner's predictions against real runs, row by row.

    cases.py     the layouts validated, each as a RunConfig and as the planner's inputs
    record.py    what one rank records while the real loop trains: bytes held, sent, kept
    held.py      rows of model state (exact) and activations (graphs exact, bytes explained)
    sent.py      rows of bytes sent per step by group (exact, runtime scalars labelled)
    bubbles.py   rows of a pipeline's bubble (slot model exact, wall clock explained)
    run.py       every case run, rows merged across ranks, the table, the exit status

A case trains in gloo processes (cases.py -> record.py per rank); the planner (plan/)
predicts the same quantities for each rank; the rows put them side by side.
"""
