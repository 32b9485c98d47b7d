"""Benchmarks, run as commands (`paratrain bench NAME`), never as timed tests: one folder
per benchmark, and the measured runs of `paratrain plan --validate`.

    command.py   the flags of every bench and the dispatch from the CLI
    harness/     what every bench shares: rank processes (spawn.py), ...
    overhead/    our training step against a plain PyTorch loop, one process
    comm/        native, ring and tree collectives: time, bandwidth, bytes, alpha-beta fit
    dp/          DataParallel against DistributedDataParallel; overlap; sync against async
    tp/          tensor parallel against DTensor's parallelize_module
    pp/          our pipeline schedules against torch.distributed.pipelining
    zero/        ZeRO 0-3 against DDP, DDP + ZeroRedundancyOptimizer, FSDP2
    layouts/     every 8-rank layout of our GPT: step time, bytes per group, memory
    planner/     `plan --validate`: the planner's predictions against real runs

How data flows through a bench: command.py turns the flags into arguments of the folder's
`run.py`, which starts the ranks through the harness; each rank builds both sides from the
same weights and batches and returns its measurements; run.py checks that the two sides
agree (losses within tolerance, else RuntimeError), summarises, logs a report and returns
the JSON-ready result that `--json` prints. The planner package imports nothing from here:
the CLI hands `plan --validate`'s runs to it.
"""
