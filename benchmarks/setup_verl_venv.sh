#!/usr/bin/env bash
# Builds the *separate* benchmark venv used to time verl 0.9.1's rollout-correction helper
# (verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask) against ours.
# Everything comes from PyPI (plus the PyTorch CPU index for torch); no verl code is vendored here.
#
# verl is installed with --no-deps (its full dependency set pulls wandb, peft, datasets, hydra, ...). Importing
# the helper module imports verl/__init__ -> verl.protocol (ray, tensordict, packaging), verl.utils.torch_functional
# (transformers), verl.workers.config (omegaconf, codetiming, orjson). Those are installed below, at versions
# inside verl 0.9.1's own requirement ranges; the helper is then imported normally (no stubs, no file loading).
#
# Usage (from anywhere):  bash benchmarks/setup_verl_venv.sh        -> creates <repo>/.venv-verl (gitignored)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-verl}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
# Same torch as the main venv (CPU build), so torch.Generator gives bit-identical inputs in both venvs: the pin is
# read from constraints/cpu.txt (the rest of that file does not apply here: verl 0.9.1 wants transformers<5.11).
TORCH_PIN=$(grep -E '^torch==' constraints/cpu.txt | cut -d' ' -f1)
"$PIP" install --retries 0 --timeout 15 "$TORCH_PIN" --index-url https://download.pytorch.org/whl/cpu \
  || "$PIP" install "$TORCH_PIN"  # fallback: plain PyPI (or a local wheelhouse configured in pip.conf)
"$PIP" install numpy psutil
"$PIP" install --no-deps verl==0.9.1
"$PIP" install "packaging>=20.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0" \
  omegaconf ray codetiming orjson
# Check: the import the benchmark needs.
VERL_USE_EXTERNAL_PLUGINS=none "$VENV/bin/python" -W ignore -c \
  "import torch, verl; from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask; print('verl', verl.__version__, 'torch', torch.__version__, 'OK')"
