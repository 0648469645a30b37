# Two commands do everything on a fresh machine: `make run` and `make test` (both set up .venv).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on this machine's disk; the `+cpu` pin fails loudly rather than
# ever pulling a multi-GB CUDA build from the index.
TORCH_WHEELS ?= /opt/wheels
TORCH := torch==2.13.0+cpu

.PHONY: setup run test test-fast lint bench golden clean test-matrix test-matrix-py312 test-megatron

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --find-links $(TORCH_WHEELS) '$(TORCH)'
	$(BIN)/python -m pip install --quiet --find-links $(TORCH_WHEELS) -e '.[test]'
	touch $(STAMP)

run: setup
	$(BIN)/inspect-model params --pp 2 --tp 2

lint: setup
	$(BIN)/ruff check inspector tests
	$(BIN)/mypy inspector

# The suite runs on every core (pytest-xdist, `-n auto`: two workers on CI's two cores), a test
# file to a worker (`--dist loadfile`: a file's module fixtures and caches are built once, as in
# one process). `make test JOBS=0` runs it in this process alone.
JOBS ?= auto
PARALLEL = -n $(JOBS) --dist loadfile

test: lint
	$(BIN)/python -m pytest -q $(PARALLEL)

# The tests marked slow left out (tests/README.md): under 2 minutes, for the loop while working.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow" -q $(PARALLEL)

# Rewrite fixtures/golden/ from the current output; review `git diff fixtures/golden` like code.
# In one process: every file it writes is written once, in the suite's order.
golden: setup
	$(BIN)/python -m pytest -q --update-golden

bench: setup
	$(BIN)/python bench/run.py

# The suite against each supported megatron-core, each in its own .venv-megatron-VERSION.
# 0.13-0.15 want numpy<2. Golden files are shared: outputs are identical on every version.
MATRIX ?= 0.13.1 0.14.0 0.15.3 0.16.1
# megatron-core 0.17+ needs Python 3.12, for which no CPU torch lies on disk: those venvs take
# PyPI's torch (a CUDA build, ~1.4 GB of downloads, ~5 GB venv; docs/contributing.md), so `make
# test` and `make run` never build one; `.ci/run` builds 0.19.2's (`make test-megatron V=0.19.2`).
# Python 3.12: pyenv's when there is one (its shim answers only where 3.12 is selected), else PATH's.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
MATRIX312 ?= 0.17.1 0.18.2 0.19.2
TORCH312 := torch==2.13.0
NEEDS312 = $(filter-out 0.13% 0.14% 0.15% 0.16%,$(1))
# torch is installed first (the CPU wheel on disk, or PyPI's for Python 3.12), so the package's
# `torch>=2.4` never asks for another one
INSTALL = .venv-megatron-$*/bin/python -m pip install --quiet --find-links $(TORCH_WHEELS) \
	'megatron-core==$*' $$(case $* in 0.13*|0.14*|0.15*) echo 'numpy<2';; esac) -e '.[test]'

test-matrix:
	@for v in $(MATRIX); do $(MAKE) --no-print-directory test-megatron V=$$v || exit 1; done

test-matrix-py312:
	@for v in $(MATRIX312); do $(MAKE) --no-print-directory test-megatron V=$$v || exit 1; done

test-megatron: .venv-megatron-$(V)/.installed
	.venv-megatron-$(V)/bin/python -m pytest -q $(PARALLEL)

.venv-megatron-%/.installed: pyproject.toml
	$(if $(call NEEDS312,$*),$(PYTHON312),$(PYTHON)) -m venv .venv-megatron-$*
	.venv-megatron-$*/bin/python -m pip install --quiet --find-links $(TORCH_WHEELS) \
		'$(if $(call NEEDS312,$*),$(TORCH312),$(TORCH))'
	$(INSTALL)
	touch $@

clean:
	rm -rf $(VENV) .venv-megatron-*
