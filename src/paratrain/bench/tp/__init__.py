"""`paratrain bench tp`: our tensor parallelism against PyTorch's DTensor tensor parallel.

peer.py      the DTensor side: the plan equivalent to GPT_TP_PLAN, its AdamW groups
compare.py   each rank: one counted step of each side, then pairs; final parameters
report.py    the loss check, ratios, bytes by op with each side's norm traffic apart
run.py       batches in (every tp rank takes the whole batch), one launch for both
             sequence-parallel modes, summaries out
"""
