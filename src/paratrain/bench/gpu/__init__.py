"""Checks that need a GPU, run by scripts/gpu-check.sh on a machine that has one.

throughput.py  one device: a GPT of about 1B parameters in bf16 through our engine and
               `train_step`: tokens/s, model FLOPs utilisation, model-state bytes (ours,
               the planner's, the allocator's high-water mark); `--device cpu --tiny` runs
               the same path in seconds
"""
