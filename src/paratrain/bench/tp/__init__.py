"""`paratrain bench tp`: our tensor parallelism against PyTorch's DTensor tensor parallel.

peer.py   the DTensor side: the plan equivalent to GPT_TP_PLAN, its step, CommCounter
run.py    each rank runs both sides pair by pair; losses checked, bytes compared
"""
