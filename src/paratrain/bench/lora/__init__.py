"""`paratrain bench lora`: LoRA against full fine-tuning, ours both.

steps.py      each rank: a full fine-tune and a LoRA fine-tune of the same model, step by
              step alternating, and what each holds per rank
curve.py      a base pre-trained, then fine-tuned both ways on supervised rows
run.py        both, summaries out
"""
