# trl-rollout-corr: the two commands a newcomer needs are `make test` and `make demo`.
# Everything installs into ./.venv (tests) and ./.venv-vllm (vLLM CPU: the main job and its end-to-end test),
# created here; nothing is downloaded at run time except packages. Both venvs install with
# `-c constraints/cpu.txt`, the one file of version pins.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS ?= constraints/cpu.txt
PYTEST_ARGS ?= -q
LINT_PATHS ?= .

.PHONY: install test test-core test-fast test-extras lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The extras the test venv holds: the trainer stack, the test tools, DeepSpeed (without compiled ops, for the 2-rank
# ZeRO-2 test), PEFT, the local trackers, the recipe's task/plot packages (tests run the recipe on a tiny model) and ruff.
TEST_EXTRAS ?= trl,test,deepspeed,peft,trackers,recipe,lint

# torch first, from the constraints (the local CPU wheel; a bare "torch" would pull a CUDA build), then the package.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo ">>> [install] torch (CPU) + trl-rollout-corr[$(TEST_EXTRAS)] into $(VENV), pins from $(CONSTRAINTS)"
	$(PIP) install -q -c $(CONSTRAINTS) torch
	DS_BUILD_OPS=0 $(PIP) install -q -c $(CONSTRAINTS) -e ".[$(TEST_EXTRAS)]"
	@touch $@

install: $(VENV)/.installed

## The whole test suite: the core and trainer tests in .venv, then the real-vLLM tests in .venv-vllm.
test: test-core test-vllm

## Core + trainer tests (tiny random models, 1- and 2-rank CPU runs); no vLLM.
test-core: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not vllm"

## Only the fast tests (about a minute): those marked `unit` (pyproject.toml registers the marker). Selecting none
## (pytest exit 5: the markers gone) fails.
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "unit and not slow"

## A fresh venv per extra ($(EXTRAS_CHECK)): install `.[extra]` alone with the constraints, import the trainer, train
## one tiny step (tests/helpers/extras_smoke.py). What a user gets from `pip install ".[peft]"`; CI runs it (.ci/run).
EXTRAS_CHECK ?= cpu trl,test deepspeed peft
EXTRAS_DIR ?= .venv-extras
test-extras:
	@set -e; for extra in $(EXTRAS_CHECK); do \
	  venv="$(EXTRAS_DIR)/$$(echo $$extra | tr , -)"; \
	  echo ">>> [extras] fresh venv $$venv: pip install -c $(CONSTRAINTS) \".[$$extra]\""; \
	  rm -rf "$$venv"; $(PY) -m venv "$$venv"; \
	  "$$venv/bin/python" -m pip install -q -c $(CONSTRAINTS) torch; \
	  DS_BUILD_OPS=0 "$$venv/bin/python" -m pip install -q -c $(CONSTRAINTS) ".[$$extra]"; \
	  "$$venv/bin/python" tests/helpers/extras_smoke.py "$$extra"; \
	  rm -rf "$$venv"; \
	done

## ruff (pyflakes, pycodestyle errors, isort; 119 columns: [tool.ruff] in pyproject.toml) over LINT_PATHS.
lint: install
	$(BIN)/ruff check $(LINT_PATHS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(EXTRAS_DIR) .pytest_cache .hypothesis .ruff_cache

# make demo, make test-vllm, the vLLM CPU venv and the model conversion.
include mk/demo.mk
