"""`paratrain bench dp`: our data parallelism against torch DistributedDataParallel, how much
of the all-reduce backward hides, and sync against async training under a straggler.

    run.py   the three parts, each in its own rank processes, and the report
"""
