"""`paratrain bench dp`: data parallelism against DDP, overlap, and sync against async.

compare.py        each rank: our engine and `train_step` against DistributedDataParallel
                  and `torch_step`, pair by pair on this rank's share of each batch
overlap.py        how much of the gradient all-reduce our backward hides, per bucket size
sync_vs_async.py  the real training loop in both modes with a 3x straggler
run.py            the three parts in turn; the DDP comparison's check and summary
"""
