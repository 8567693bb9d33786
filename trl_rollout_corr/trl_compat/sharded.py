"""The parameter-sharding backends (accelerate 1.15, DeepSpeed ZeRO-3, FSDP1/2) as the trainer sees them.

================================  ==========================================================================
here                              accelerate 1.15 / torch
================================  ==========================================================================
``sharded_backend``               accelerate 1.15's ``state.deepspeed_plugin.zero_stage`` /
                                  ``state.fsdp_plugin.fsdp_version`` (as transformers' Trainer reads them);
                                  ``full_parameter_bytes``: DeepSpeed's ``ds_numel``, FSDP2's global DTensor size
``fsdp2_wrapped_method``          torch's ``register_fsdp_forward_method`` wrapper (transformers' Trainer registers
                                  ``generate`` with it under FSDP), recognised by its code object
================================  ==========================================================================

Pinned in ``tests/trainer/test_trl_compat.py``.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any, Optional

import torch


def sharded_backend(accelerator: Any) -> Optional[str]:
    """The parameter-sharding backend the trainer runs under: ``"DeepSpeed ZeRO-3"``, ``"FSDP2"``, ``"FSDP1"``, or
    None (single process, DDP, DeepSpeed ZeRO-1/2: every rank holds the full weights).

    Read from accelerate 1.15's state, as transformers' Trainer reads it for ``is_deepspeed_enabled`` /
    ``is_fsdp_enabled``: ``accelerator.state.deepspeed_plugin.zero_stage`` and
    ``accelerator.state.fsdp_plugin.fsdp_version``.
    """
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp is not None:
        return "FSDP2" if getattr(fsdp, "fsdp_version", 1) == 2 else "FSDP1"
    return None


def dropped_fsdp(args: Any, accelerator: Any) -> bool:
    """True when ``args`` asks for FSDP (``fsdp=...``: transformers builds ``args.fsdp_plugin_args``) but the
    accelerator runs without it: accelerate 1.15's ``AcceleratorState`` keeps an FSDP plugin only on accelerator
    device types (``MULTI_GPU``, ``MULTI_XPU``, ...), so on CPU ranks (``use_cpu=True``) it silently runs DDP.
    FSDP asked for by ``accelerate launch`` with an FSDP config (``ACCELERATE_USE_FSDP=true`` in the environment)
    counts as asked for too."""
    asked = bool(getattr(args, "fsdp_plugin_args", None)) or \
        os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("1", "true", "yes")
    return asked and getattr(accelerator.state, "fsdp_plugin", None) is None


def full_parameter_bytes(model: torch.nn.Module, world_size: int = 1) -> int:
    """Bytes of the full (unsharded) parameters of ``model``, whatever shards them.

    DeepSpeed ZeRO-3 keeps the full size in ``param.ds_numel`` (the parameter itself is empty outside a gather);
    an FSDP2 ``DTensor`` reports the global ``numel()``; an FSDP1 ``FlatParameter`` holds this rank's padded
    shard of the flattened parameters (counted ``world_size`` times: an upper bound by the padding).
    """
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_numel"):
            numel = int(p.ds_numel)
        elif type(p).__name__ == "FlatParameter":
            numel = int(p.numel()) * world_size
        else:
            numel = int(p.numel())
        total += numel * p.element_size()
    return total


@functools.lru_cache(maxsize=None)
def _fsdp2_wrapper_code():
    """The code object of the method wrapper that torch's ``register_fsdp_forward_method`` installs (its nested
    ``wrapped_method``); None where this torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for const in register_fsdp_forward_method.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "wrapped_method":
            return const
    return None


def fsdp2_wrapped_method(method: Any) -> Optional[Any]:
    """The method FSDP2 wrapped, when ``method`` is the wrapper ``torch.distributed.fsdp.register_fsdp_forward_method``
    set on an ``FSDPModule`` (transformers' Trainer registers ``generate`` so, with FSDP enabled, so that
    ``model.generate`` all-gathers the shards first); else None.

    The wrapper is recognised by its code object (``functools.wraps`` copies the wrapped method's name and module
    onto it), and the wrapped method is its ``__wrapped__`` (a bound method). Pinned in
    ``tests/trainer/test_trl_compat.py``: fails loudly if torch renames or restructures the wrapper.
    """
    func = getattr(method, "__func__", None)
    code = _fsdp2_wrapper_code()
    if func is None or code is None or getattr(func, "__code__", None) is not code:
        return None
    return getattr(func, "__wrapped__", None)
