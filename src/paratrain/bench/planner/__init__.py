"""`paratrain plan --validate`: the planner's predictions against real runs, row by row.

A case (cases.py) is a layout trained a few steps through the real loop in gloo processes;
each rank records what it held, sent and kept (record.py); the planner (plan/) predicts
the same quantities for that rank; the rows put them side by side (held.py: model state
and activations; sent.py: bytes per group; bubbles.py: the pipeline's idle time) and
run.py merges equal rows across ranks, prints the table and sets the exit status.
"""
