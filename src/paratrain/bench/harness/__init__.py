"""What every benchmark (and the multi-process tests, through tests/distributed.py) shares.

spawn.py   run a function in k gloo processes from a warm forkserver: results back by
           rank, a failing rank's traceback, a hung rank named
"""
