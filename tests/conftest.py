import os

# Keep every test process (and the forkserver it starts) to one thread on these 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
