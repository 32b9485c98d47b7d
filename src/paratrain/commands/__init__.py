"""The command line's commands, one module each with its arguments and its run; cli.py is
their registry. `schedule` is here; train, eval, sample, export, import-hf, prepare,
tokenizer, plan and bench still live where cli.py points (issue 29 moves them).

May import everything below it (every package but cli.py and launch.py).
"""
