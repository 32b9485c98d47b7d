"""One replica group's elastic agent: `python -m paratrain.fault_tolerance.group_agent
GROUP NPROC MAX_RESTARTS ARGV...` starts the group's NPROC workers (ARGV is the workers'
`paratrain` command line) and relaunches them after a failure, up to MAX_RESTARTS times,
while the other groups go on. The launcher starts one per group, with the coordinator's
address in the environment; under torchrun each group is its own job, as here."""

from __future__ import annotations

import os
import sys

from paratrain.fault_tolerance.group_env import GROUP_VAR


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.launch import WorkersFailed, launch_workers

    group, nproc, max_restarts, rest = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    os.environ[GROUP_VAR] = str(group)
    try:
        launch_workers(nproc, rest, max_restarts)
    except WorkersFailed as e:
        print(f"paratrain: replica group {group}: {e}", file=sys.stderr, flush=True)
        return e.exitcode if e.exitcode > 0 else 1
    except SignalException as e:  # the launcher's stop, passed on to the workers: they saved
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
