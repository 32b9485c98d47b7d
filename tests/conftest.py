import logging
import os

import pytest

# Keep every test process (and the forkserver it starts) to one thread on these 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
