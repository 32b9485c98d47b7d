# Two commands on a fresh machine: `make demo` (train) and `make test` (the test suite).
# Both create .venv if missing and install paratrain with its test extras; constraints.txt
# pins torch 2.13.0, whose CPU wheel pip finds on this machine's disk (about a minute).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean test-versions test-aten-default

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --constraint constraints.txt --editable '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	out=runs/demo-$$(date +%Y%m%d-%H%M%S) && $(VENV)/bin/paratrain train --out $$out && \
	$(VENV)/bin/paratrain sample $$out --prompt "def " --max-new-tokens 200

# Three workers on two cores: many tests wait (process start-up, a straggler's sleep, a
# signal's round trip), and a third worker fills those gaps: make test took 14 min 09 s
# on a fresh clone (2026-12-03) against 14 min 46 s and 15 min 16 s with two.
# The time depends on the machine far more than on the tests: 1,403 tests took 7 min 01 s
# on a fresh clone on an AMD EPYC with AVX-512 (2026-12-04, nothing else running) and
# 20-27 min on the machine of the day before, 31 min in CI, where some 4-rank tests ran
# 40 times slower than here. Hence hang guards of 600 s and more (pyproject.toml), and
# the longest files first (tests/conftest.py). A fourth worker does not pay: on 2026-12-05
# the suite kept both cores 97% busy (/proc/stat) with three, and took 13 min 34 s with
# four against 13 min 04 s with three. On an Intel Xeon (AVX-512, 2 cores; 2026-12-06) the
# same suite took 15 min 44 s, and 16 min 43 s to 17 min 05 s with 7 tests more that day;
# 1,841 to 1,845 tests took 16 min 51 s to 17 min 06 s on 2026-12-07, and 1,852 to 1,856
# later that day 19 min 34 s to 20 min 08 s, both cores 97% busy throughout (/proc/stat):
# over the 15-minute aim there, and bound by CPU work alone. 1,870 tests took
# 16 min 26 s (2,017 busy core-seconds) there on 2026-12-07, and 15 min 57 s, 16 min
# 33 s and 16 min 46 s (1,945, 2,018 and 2,036) once test_simulate had 4 layers
# instead of 8 and 1F1B's K 8 instead of 16 (a simulated layer costs a rank about
# 0.17 s; test_simulate.py alone 312 -> 220 busy core-seconds): runs of the same tree
# differ by as much. Tried and left out:
# workers forked from a preloaded forkserver (launch.py starts each as `python -m
# paratrain`, about 2 s of imports): 13 -> 6 core-seconds for a 4-worker launch, but the
# fault-tolerance tests start one worker per group, where the server costs what the
# worker did (one such test 36 -> 42 busy core-seconds, one run each), and a worker
# forked so missed the terminal's Ctrl-C save (test_stop_signals).
# Ranks forked from each elastic agent instead (torch's start method "fork", the agent
# importing what a rank needs first; 2026-12-08, one run each, this Xeon): the fault-
# tolerance, stop and CLI files 1,673 (spawned, earlier that day) -> 859 busy core-seconds.
# Left out: torch's function context reports only the first rank it saw fail, so the
# launcher named a rank that printed nothing (test_reliability_cli's damaged checkpoint,
# once in one run); a rank's return value needs a private hook into torch's `_wrap`; and
# it exposed a relaunch faster than the heartbeat timeout, since fixed (incarnations).
# Where the CPU goes (2026-12-07, Intel Xeon, a slow hour: 1,894 tests, 25 min 42 s, 3,079
# busy core-seconds, of which 2,986 were counted per test by scripts/test_cpu.py, `pytest
# -p scripts.test_cpu`: each xdist worker and every process below it): the fault-tolerance
# files 32% (test_fault_tolerance 452, _layouts 428, test_diloco_fault_tolerance 93),
# test_simulate 15% (450), test_comm_order_grid 143, test_train_cli 138,
# test_reliability_cli 132, the rest under 100 each. A fault-tolerance run is nearly all
# start-up: every group's agent (1.6 s, `import torch`) and every rank (3.3 s: torch,
# torch.distributed.checkpoint and torch._dynamo, which torch.optim's step imports) is
# a fresh interpreter, and a rank's 12 steps of the 2-layer model take well under one.
test: setup
	$(VENV)/bin/python -m pytest -ra --durations=10 -n 3 --dist loadfile

# --- the other supported PyTorch releases (pyproject.toml: torch>=2.11,<=2.14.1) -----------
# One virtual environment per release, TORCH_VENVS/venv-torch-V, from the package index:
# torch==V, paratrain editable with its test extras, and constraints.txt's other pins. PyPI's
# torch for Linux x86_64 is a CUDA build (2.11.0 with its nvidia-* and cuda-* wheels is about
# 2.6 GB); it runs on the CPU. Wheels are kept in WHEEL_CACHE, outside the clone, so a
# machine downloads each file once: `pip download` skips the files already there, then the
# install reads only that folder.
# Cost on this machine (2 shared cores), measured: warm (wheels cached), 3 to 4.5 minutes per
# release, nearly all of it pip unpacking torch and its nvidia-* wheels; cold, add the
# download, about 2 minutes per release. A venv already built costs seconds (the editable
# install of this clone).
TORCH_VERSIONS := 2.11.0 2.14.1
WHEEL_CACHE ?= $(HOME)/.cache/paratrain/wheels
# The venvs live outside the clone too, built once per machine (TORCH_VENVS/venv-torch-V);
# each clone then only installs itself into them, editable (seconds).
TORCH_VENVS ?= $(HOME)/.cache/paratrain
# The equivalence subset (tests marked `equivalence`: every strategy, schedule and attention
# once against plain PyTorch, and a resume), two test files at a time.
EQUIVALENCE := -m equivalence -ra -n 2 --dist loadfile

$(TORCH_VENVS)/venv-torch-%/.base:
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	grep -v '^torch==' constraints.txt > $(@D)/constraints.txt
	mkdir -p $(WHEEL_CACHE)
	$(@D)/bin/python -m pip download --quiet --dest $(WHEEL_CACHE) \
	    --constraint $(@D)/constraints.txt 'torch==$*' '.[test]' 'setuptools>=68' wheel
	$(@D)/bin/python -m pip install --quiet --no-index --find-links $(WHEEL_CACHE) \
	    --constraint $(@D)/constraints.txt 'torch==$*' '.[test]'
	touch $@

# A stamp is the venv's, not an intermediate file of `venv-torch-V`: make must keep it.
.PRECIOUS: $(TORCH_VENVS)/venv-torch-%/.base
# A venv built before a dependency was added lacks its wheel in WHEEL_CACHE: the offline
# install then fails, and the cache is topped up (`pip download` fetches only what is missing).
venv-torch-%: $(TORCH_VENVS)/venv-torch-%/.base
	grep -v '^torch==' constraints.txt > $(TORCH_VENVS)/venv-torch-$*/constraints.txt
	$(TORCH_VENVS)/venv-torch-$*/bin/python -m pip install --quiet --no-index \
	    --find-links $(WHEEL_CACHE) --constraint $(TORCH_VENVS)/venv-torch-$*/constraints.txt \
	    'torch==$*' --editable '.[test]' || \
	( $(TORCH_VENVS)/venv-torch-$*/bin/python -m pip download --quiet --dest $(WHEEL_CACHE) \
	    --constraint $(TORCH_VENVS)/venv-torch-$*/constraints.txt 'torch==$*' '.[test]' && \
	  $(TORCH_VENVS)/venv-torch-$*/bin/python -m pip install --quiet --no-index \
	    --find-links $(WHEEL_CACHE) --constraint $(TORCH_VENVS)/venv-torch-$*/constraints.txt \
	    'torch==$*' --editable '.[test]' )
	$(TORCH_VENVS)/venv-torch-$*/bin/python -c "import torch; \
	    assert torch.__version__.split('+')[0] == '$*', torch.__version__; \
	    print('torch', torch.__version__, 'on the CPU:', torch.ones(2) @ torch.ones(2))"

test-torch-%: venv-torch-%
	$(TORCH_VENVS)/venv-torch-$*/bin/python -m pytest $(EQUIVALENCE)

# torch 2.13 on its most portable CPU kernels (no AVX2/AVX-512): another summation order.
test-aten-default: setup
	ATEN_CPU_CAPABILITY=default $(VENV)/bin/python -m pytest $(EQUIVALENCE)

test-versions: $(TORCH_VERSIONS:%=test-torch-%) test-aten-default

# Lint and types: ruff's checks and formatting, then mypy as pyproject.toml's [tool.mypy]
# says (all of src/paratrain; strict on comm/, parallel/, plan/, data/, measure/, mesh.py
# and module_names.py).
lint: setup
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache  # the venvs of other releases stay: TORCH_VENVS
