# Two entry points: `make demo` (install, then run the main job on the CPU) and
# `make test` (install with test extras, then run the whole suite; `make test-fast`: all but
# the slow tests).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP_FLAGS := --disable-pip-version-check --no-input -q
# Tests keep JAX on the CPU and quiet; XLA uses the cores it is given.
TEST_ENV := JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3
# Test processes (pytest-xdist); each test file runs whole in one of them, so its
# module-scoped fixtures (built and compiled models) are made once; files are handed out
# in the order tests/conftest.py collects them (the slowest first).
TEST_WORKERS ?= 2

.PHONY: demo test test-fast lint format install install-test install-lint bench clean config-docs

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade "pip>=24"

$(VENV)/.installed: setup.py | $(VENV)/bin/python
	$(PY) -m pip install $(PIP_FLAGS) -e .
	touch $@

$(VENV)/.installed-test: setup.py | $(VENV)/bin/python
	$(PY) -m pip install $(PIP_FLAGS) -e ".[test]"
	touch $(VENV)/.installed $@

$(VENV)/.installed-lint: setup.py | $(VENV)/bin/python
	$(PY) -m pip install $(PIP_FLAGS) -e ".[lint]"
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-lint: $(VENV)/.installed-lint

demo: install
	$(TEST_ENV) $(PY) -m experiments.demo --workdir runs/demo

PYTEST := $(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The whole suite; the log ends with the 25 slowest tests.
test: install-test
	$(PYTEST) --durations=25 tests

# Everything but the tests marked slow (tests/conftest.py: end-to-end runs, simulated meshes,
# compile-heavy equivalence checks).
test-fast: install-test
	$(PYTEST) -m "not slow" tests

# Formatting and lint rules (line length 100) from pyproject.toml: `lint` checks, `format` applies.
lint: install-lint
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: install-lint
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Every CPU benchmark in turn (tens of minutes); each prints a table and writes JSON.
bench: install-test
	$(TEST_ENV) $(PY) -m benchmarks.bench_core
	$(TEST_ENV) $(PY) benchmarks/bench_moe.py
	$(TEST_ENV) $(PY) -m benchmarks.bench_sampling
	$(TEST_ENV) $(PY) -m benchmarks.bench_async
	$(TEST_ENV) $(PY) -m benchmarks.bench_rewards
	$(TEST_ENV) $(PY) -m benchmarks.bench_code_rewards
	$(TEST_ENV) $(PY) -m benchmarks.bench_rl

clean:
	rm -rf $(VENV) runs build *.egg-info

# The field reference of docs/configuration.md, from the config schema (policyopt.config).
config-docs: install
	$(TEST_ENV) $(PY) -m experiments.config_docs
