"""Where the test suite's CPU goes: each test's CPU seconds, its xdist worker's and every
process below it (the ranks, `paratrain train` runs and their agents), so that a test's
subprocesses count for it even when they run beside other tests.

    rm -f test-cpu.jsonl   # each run appends (TEST_CPU_OUT names another file)
    .venv/bin/python -m pytest -p scripts.test_cpu -n 3 --dist loadfile
    .venv/bin/python scripts/test_cpu.py test-cpu.jsonl                   # per file, then per test

A process that ended during the test is counted through its parent's cutime/cstime
(/proc/PID/stat), which Linux adds once the parent has reaped it; the forkserver that
forks `run_distributed`'s ranks lives on, and its growing cutime is its ranks'. Linux only.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

OUT = Path(os.environ.get("TEST_CPU_OUT", "test-cpu.jsonl"))
TICK = os.sysconf("SC_CLK_TCK")


def _ticks_below(root: int) -> dict[int, int]:
    """Each process in root's tree: its own and its reaped children's CPU ticks."""
    stats: dict[int, tuple[int, int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # gone
        fields = text[text.rindex(")") + 2 :].split()
        stats[int(name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (parent, _) in stats.items():
        children[parent].append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree[pid] = stats[pid][1]
        todo.extend(children[pid])
    return tree


_before: dict[int, int] = {}
_controller = False  # an xdist controller: its workers count their own tests


def pytest_configure(config):  # noqa: ANN001, ANN201 (pytest's hook)
    global _controller
    is_worker = hasattr(config, "workerinput")
    _controller = not is_worker and bool(config.getoption("numprocesses", default=None))


def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 (pytest's hook)
    global _before
    _before = _ticks_below(os.getpid())


def pytest_runtest_logfinish(nodeid, location):  # noqa: ANN001, ANN201 (pytest's hook)
    if _controller:
        return
    after = _ticks_below(os.getpid())
    ticks = sum(n - _before.get(pid, 0) for pid, n in after.items())
    with OUT.open("a") as f:
        f.write(json.dumps({"test": nodeid, "cpu_s": ticks / TICK}) + "\n")


def main(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    total = sum(r["cpu_s"] for r in rows)
    by_file: collections.Counter[str] = collections.Counter()
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu_s"]
    print(f"{len(rows)} tests, {total:,.0f} CPU seconds")
    for name, seconds in by_file.most_common(20):
        print(f"{seconds:8.1f} {100 * seconds / total:5.1f}%  {name}")
    print()
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:30]:
        print(f"{r['cpu_s']:8.1f}  {r['test']}")


if __name__ == "__main__":
    main(sys.argv[1])
