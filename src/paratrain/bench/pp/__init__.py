"""`paratrain bench pp`: our pipeline schedules against `torch.distributed.pipelining`.

peer.py      torch's schedule classes over the same chunks, and the peer's step
compare.py   each rank: our PipelineEngine and `train_step` against the peer, pair by
             pair after a barrier; the runtime's trace of every timed step
report.py    per schedule: the loss check on the last stage, the slower rank's times,
             the bubble beside simulation and formula, Gantt chart and Chrome trace
run.py       flags checked, batches read once, one launch for every schedule
"""
