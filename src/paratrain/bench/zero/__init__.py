"""`paratrain bench zero`: each ZeRO stage against its PyTorch-native peer on the same GPT.

peer.py     the peers (DDP, + ZeroRedundancyOptimizer, FSDP2), their bytes held and sent
run.py      each rank runs both sides pair by pair, counts one step's bytes
report.py   per stage: ratios, the loss check, bytes against the closed forms, the PNG
"""
