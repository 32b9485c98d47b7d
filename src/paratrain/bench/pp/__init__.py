"""`paratrain bench pp`: our pipeline schedules against `torch.distributed.pipelining`.

compare.py   what each rank runs: both pipelines on the same split, pair by pair
run.py       batches in, per-schedule summary, bubble beside simulation and formula,
             Gantt chart and Chrome trace out
"""
