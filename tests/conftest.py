import logging
import os

import pytest

# Keep every test process (and the forkserver it starts) to one thread on these 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files that take longest (each 40-150 s of a 7-minute run on 2 cores, 2026-12-04),
# longest first. `-n 3 --dist loadfile` hands out files in collection order; the rest
# follow alphabetically, so one of these starting last would leave two workers idle
# behind it (the alphabetical order ended on test_reliability_cli, test_simulate,
# test_stop_signals and test_train_cli). Not test_overlap (100 s): it times, and beside
# the two files that launch the most one of its cases took 63 s against 26 s mid-run;
# test_fault_tolerance (110 s, 3-4 processes and a coordinator per run) beside it once
# pushed a case below its goal: it goes early, far from test_overlap.
LONGEST_FIRST = (
    "test_reliability_cli.py",
    "test_train_cli.py",
    "test_fault_tolerance.py",
    "test_simulate.py",
    "test_comm_order_grid.py",
    "test_default_device.py",
    "test_eval_mesh.py",
    "test_stop_signals.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regen-golden",
        action="store_true",
        help="write tests/golden/ afresh from this machine's float64 references",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as is


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One inductor/FX cache for the session's --compile tests, so identical blocks in every
    rank and test compile once; a TORCHINDUCTOR_CACHE_DIR already set is kept (a warm
    cache across sessions). Ranks come from a forkserver started before this fixture, so
    each rank sets the variable itself (tests/test_compile.py)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture(autouse=True)
def _root_logger_as_it_was():
    """`paratrain.cli.main` run in a test configures logging on the stderr that capsys gives
    that test; a later test must not log to that stream once it is closed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """Every `paratrain train` a test started (tests/runs.py) ends with the test, with all
    it started, whether the test passed or not."""
    from tests.runs import stop_leftovers

    yield
    stop_leftovers()
