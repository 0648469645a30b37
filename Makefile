# Two commands do everything on a fresh machine: `make run` and `make test` (both set up .venv).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on this machine's disk; the `+cpu` pin fails loudly rather than
# ever pulling a multi-GB CUDA build from the index.
TORCH_WHEELS ?= /opt/wheels
TORCH := torch==2.13.0+cpu

.PHONY: setup run test lint bench clean

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

test: lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV)
