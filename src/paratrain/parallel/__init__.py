"""Functions and wrappers that make a plain model parallel, each taking one group from the Mesh.

Applied from outside in the architecture's order, every rank starting from the same full
model: tensor parallelism slices layers (tensor_parallel*.py, collectives from
comm/regions.py), recompute.py wraps blocks, pipeline/ keeps this stage's chunks, and a
data-parallel wrapper goes last (data_parallel.py with buckets.py, zero.py with
flat_buffer.py, fsdp.py with fsdp_units.py; mixed_precision.py and adamw.py serve them). Every
wrapper answers the `Replica` protocol (replica.py, sharded_replica.py), which is all a training
step asks of it; async_sgd.py is the parameter server. All traffic goes through comm/.
"""
