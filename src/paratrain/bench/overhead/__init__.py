"""`paratrain bench overhead`: our training step against a plain PyTorch loop, one process.

run.py   both loops on the same preloaded batches, in alternating rounds; the medians
         of per-step times and their ratio; the loss curves must agree
"""
