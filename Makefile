# Developer entry points on Linux (CPU MLX). `make demo` and `make test` each set up .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: setup demo lint test test-replicas bench-quick

# The bootstrap .pth is copied into site-packages at install time: a change to it needs a reinstall.
$(STAMP): pyproject.toml requirements/linux-host.txt requirements/linux-nodeps.txt requirements/test.txt requirements/lint.txt \
		vllm_mlx_mtp_routing/host/vllm_mlx_mtp_routing_bootstrap.pth
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/linux-host.txt -r requirements/test.txt -r requirements/lint.txt
	$(BIN)/pip install -q --no-deps -r requirements/linux-nodeps.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

# Lint and type check (configured in pyproject.toml); `make test` runs them first.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two workers (pytest-xdist): the suite is mostly server subprocesses and their clients taking turns on the CPU.
TEST_WORKERS ?= 2
# Bytecode of the checkout's own modules (an editable install) is written (to its ignored __pycache__ folders) even
# where the environment turns that off: each fresh interpreter of the suite would otherwise compile them again.
test: export PYTHONDONTWRITEBYTECODE :=
test: setup lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not replicas"

# Replicas behind a real router (docs/replicas.md): the routers are Rust binaries in wheels of their own (~25-30 MB
# each), kept out of the suite's requirements and of the host's environment, in a virtual environment beside it.
ROUTER_VENV := .venv-router
$(ROUTER_VENV)/.installed: requirements/router.txt
	$(PY) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q -r requirements/router.txt
	touch $(ROUTER_VENV)/.installed

test-replicas: export PYTHONDONTWRITEBYTECODE :=
test-replicas: setup $(ROUTER_VENV)/.installed
	$(BIN)/python -m pytest -q -s -m replicas tests/test_replicas_e2e.py

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install -q "matplotlib>=3.7"
	touch $(VENV)/.bench

bench-quick: $(VENV)/.bench
	$(BIN)/python benchmarks/serve_bench.py --quick
