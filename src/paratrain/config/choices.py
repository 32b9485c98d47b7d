"""The valid values of the string (and stage) fields, defined once: the fields' facts take
them (so the checks and `--help` do), and the modules that implement each option take their
lists from here."""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # parallel/pipeline/schedules.py
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # in code only
RECOMPUTE_MODES = ("none", "selective", "full")  # parallel/recompute.py
ZERO_STAGES = (0, 1, 2, 3)
ZERO2_ACCUMULATE = ("full", "shard")
COMM_ALGOS = ("native", "ring", "tree")
COMM_ORDERS = ("gloo", "nccl")  # comm/ordering.py
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
DP_MODES = ("sync", "async", "diloco")
COMPRESS_METHODS = ("none", "powersgd", "int8", "sign")  # parallel/data_parallel/compression.py
OUTER_DTYPES = ("float32", "bfloat16", "int8", "fp4")  # DiLoCo's on the wire: comm/codecs.py
FT_DATA = ("drop", "replay")  # fault_tolerance/quorum.py: assign_slots
DC_MODES = ("constant", "adaptive")  # DC-ASGD-c and DC-ASGD-a (parallel/data_parallel/dc_asgd.py)
LR_SCALINGS = ("none", "linear", "sqrt")
OPTIMIZERS = ("adamw", "muon", "sgd")  # parallel/data_parallel/adamw.py, muon.py, sgd.py
MUON_LR_ADJUSTS = ("original", "match-rms-adamw")  # parallel/data_parallel/muon_math.py
MUON_NS_DTYPES = ("bfloat16", "float32")  # or auto: config/resolution.py
# How a batch's rows are cut from the data (data/document_rows.py); auto: one padded row
# per document for supervised data, windows of the token stream otherwise.
PACKINGS = ("auto", "stream", "documents", "none")
CP_METHODS = ("ring", "alltoall")  # parallel/context_parallel/apply.py: METHODS
ARCHS = ("gpt", "llama")  # models/gpt.py, models/llama.py
GELUS = ("gelu", "gelu_tanh")
AUTO = "auto"  # device, backend and dtype: chosen by resolve (config/resolve.py)
