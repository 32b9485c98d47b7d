# Two commands on a fresh machine: `make demo` (train) and `make test` (the test suite).
# Both create .venv if missing and install paratrain with its test extras; constraints.txt
# pins torch 2.13.0, whose CPU wheel pip finds on this machine's disk (about a minute).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --constraint constraints.txt --editable '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	out=runs/demo-$$(date +%Y%m%d-%H%M%S) && $(VENV)/bin/paratrain train --out $$out && \
	$(VENV)/bin/paratrain sample $$out --prompt "def " --max-new-tokens 200

test: setup
	$(VENV)/bin/python -m pytest -ra --durations=10 -n 2 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
