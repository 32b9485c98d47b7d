"""`paratrain bench zero`: each ZeRO stage against its PyTorch-native peer on the same GPT.

peer.py       the peers (DDP, + ZeroRedundancyOptimizer, FSDP2) and their bytes held
compare.py    each rank: our engine and `train_step` against the peer, pair by pair,
              then one step of each whose bytes are counted
formulas.py   the closed forms: model state, the paper's volume, our step's scalars
report.py     per stage: the loss check, ratios, bytes against the closed forms, PNG
run.py        batches read once, one launch per stage, summaries out
"""
