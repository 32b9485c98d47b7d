"""`paratrain bench muon`: our Muon against torch.optim.Muon under DDP and under
ZeroRedundancyOptimizer at 2 ranks, and Muon against AdamW in a training run.

compare.py    each rank: our engine and `train_step` against the peer, pair by pair
run.py        the two timed comparisons, the training runs, summaries out
"""
