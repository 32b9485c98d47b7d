"""Benchmarks, run as commands (`paratrain bench NAME`), never as timed tests: one folder
per benchmark, and the measured runs of `paratrain plan --validate`.

    harness/     what the benches share: rank processes, timed pairs, the two sides' steps,
                 bytes counted on both sides
    gpu/         scripts for a CUDA machine: one GPU's throughput; torch's context parallel
    overhead/    our training step against a plain PyTorch loop, one process
    comm/        native, ring and tree collectives: time, bandwidth, bytes, alpha-beta fit
    dp/          data parallel against DistributedDataParallel; overlap; sync against async
    tp/          tensor parallel against DTensor's parallelize_module
    pp/          our pipeline schedules against torch.distributed.pipelining
    zero/        ZeRO 0-3 against DDP, DDP + ZeroRedundancyOptimizer, FSDP2
    layouts/     every 8-rank layout of our GPT: step time, bytes per group, memory
    cp/          ring and all-to-all attention against one process's attention
    moe/         expert dispatch and combine against tokens per rank
    planner/     `plan --validate`: the planner's predictions against real runs

How data flows through a bench: commands/bench.py turns the flags into the arguments of the
folder's `run.py`, which reads the batches once and starts the ranks through the harness;
each rank (the folder's `compare.py`) builds both sides from the same weights, runs them
pair by pair on the same batches and returns its times, losses and bytes; `run.py` and
`report.py` check that the two sides agree (losses within tolerance, else RuntimeError),
summarise, log a report and return the JSON-ready result that `--json` prints.

Every bench that times our training step runs the one `train_step` through the engine
`paratrain train` would build (harness/sides.py: OurSide). The planner imports nothing
from here: the CLI hands `plan --validate`'s runs to it.
"""
