"""`paratrain bench overhead`: our training step (`train_step` through a `FlatEngine`)
against a plain PyTorch loop in one process, same model, batches and optimizer.

    run.py   both loops in alternating rounds; the medians and their ratio
"""
