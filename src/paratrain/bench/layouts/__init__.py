"""`paratrain bench layouts`: every 8-rank layout of our GPT trained a few steps through the
real loop: step time, bytes sent per rank by group, model-state bytes per rank.

    run.py   the layouts, one launch of 8 rank processes, the table
"""
