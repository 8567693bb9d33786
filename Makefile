# trl-rollout-corr: the two commands a newcomer needs are `make test` and `make demo`.
# Everything installs into ./.venv (tests) and ./.venv-vllm (vLLM CPU: the main job and its end-to-end test),
# created here; nothing is downloaded at run time except packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?= -q

.PHONY: install test test-core test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned to the CPU wheel this machine ships (a bare "torch" would pull a CUDA build).
# DeepSpeed (without compiled ops) for the 2-rank ZeRO-2 test.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo ">>> [install] torch 2.13.0 (CPU) + trl-rollout-corr[trl,test] + deepspeed into $(VENV)"
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[trl,test]"
	DS_BUILD_OPS=0 $(PIP) install -q "deepspeed==0.19.8"
	@touch $@

install: $(VENV)/.installed

## The whole test suite: the core and trainer tests in .venv, then the real-vLLM tests in .venv-vllm.
test: test-core test-vllm

## Core + trainer tests (tiny random models, 1- and 2-rank CPU runs); no vLLM.
test-core: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not vllm"

## Only the pure-math tests (seconds).
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/test_config.py tests/test_correction.py tests/test_metrics.py tests/test_properties.py tests/test_losses.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis

# make demo, make test-vllm, the vLLM CPU venv and the model conversion.
include mk/demo.mk
