# trl-rollout-corr: the two commands a newcomer needs are `make test` and `make demo`.
# Everything installs into ./.venv (created here); nothing is downloaded at run time except packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?= -q

.PHONY: install test test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned to the CPU wheel this machine ships (a bare "torch" would pull a CUDA build).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo ">>> [install] torch 2.13.0 (CPU) + trl-rollout-corr[trl,test] into $(VENV)"
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[trl,test]"
	@touch $@

install: $(VENV)/.installed

## Run the test suite (installs what it needs first).
test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Only the pure-math tests (no TRL models).
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/test_config.py tests/test_correction.py tests/test_metrics.py tests/test_properties.py tests/test_losses.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
