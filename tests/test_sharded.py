"""Sharded backends (DeepSpeed ZeRO-3, FSDP2): the pieces that recognise them (unit tests), and 2 real CPU ranks
over gloo against 1 rank on the same fixed rollout table (``tests/dist_sharded_worker.py``; slow: three torchrun
launches, about 2-3 minutes in all on 2 cores).

The 2-rank runs check, per backend and feature: a rank's parameter really is partial (ZeRO-3 ``ds_tensor`` /
FSDP2 DTensor local shard smaller than the full tensor), the loss, grad_norm and every ``rollout_corr/*`` value of
every step equal the 1-rank run's within ``TOL``, or the trainer refuses the feature at construction with its reason;
and docs/architecture.md's rule: every forward runs on every rank the same number of times, also when the rows
differ between ranks (stale rows on rank 0 only: a hang otherwise, caught by the launch's timeout).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from tiny_model import make_tiny_model
from trl_rollout_corr import trl_compat
from trl_rollout_corr.features.behaviour import plain_generate_has_no_mu


# ---------------------------------------------------------------------------------------------- unit
def _as_fsdp2_module(model):
    """``model`` with the class ``fully_shard`` gives it (``FSDP<cls>`` over ``FSDPModule``), without sharding
    (registering a forward method needs the class only; its call would need a process group)."""
    cls = type(model)
    model.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return model


def _sampling_trainer():
    return types.SimpleNamespace(generation_config=GenerationConfig(do_sample=True))


@pytest.mark.unit
def test_fsdp2_wrapped_generate_is_transformers_own_and_replacements_stay_refused():
    """transformers' Trainer, under FSDP, sets torch's ``register_fsdp_forward_method`` wrapper on
    ``model.generate``: that is transformers' generate (mu can be captured), not a replacement (issue 46); a
    replacement stays refused, also behind FSDP2's wrapper or behind an ordinary ``functools.wraps`` wrapper."""
    model, _ = make_tiny_model("llama", seed=0)
    assert plain_generate_has_no_mu(_sampling_trainer(), model) is None
    model = _as_fsdp2_module(model)
    register_fsdp_forward_method(model, "generate")
    own = vars(model)["generate"]
    assert own.__func__ is not GenerationMixin.generate  # the wrapper: before the fix this was refused
    inner = trl_compat.fsdp2_wrapped_method(own)
    assert isinstance(inner, types.MethodType) and inner.__func__ is GenerationMixin.generate
    assert inner.__self__ is model
    assert plain_generate_has_no_mu(_sampling_trainer(), model) is None

    def fake_generate(*args, **kwargs):
        raise AssertionError("never called")

    replaced, _ = make_tiny_model("llama", seed=0)
    replaced = _as_fsdp2_module(replaced)
    replaced.generate = fake_generate
    register_fsdp_forward_method(replaced, "generate")
    assert trl_compat.fsdp2_wrapped_method(vars(replaced)["generate"]) is fake_generate
    assert "model.generate has been replaced by <function" in plain_generate_has_no_mu(_sampling_trainer(), replaced)

    other, _ = make_tiny_model("llama", seed=0)
    wrapper = functools.wraps(other.generate)(lambda *a, **k: other.generate(*a, **k))
    other.generate = types.MethodType(lambda self, *a, **k: wrapper(*a, **k), other)
    assert trl_compat.fsdp2_wrapped_method(vars(other)["generate"]) is None
    assert "has been replaced" in plain_generate_has_no_mu(_sampling_trainer(), other)
    assert trl_compat.fsdp2_wrapped_method(None) is None and trl_compat.fsdp2_wrapped_method(print) is None


@pytest.mark.unit
def test_sharded_backend_and_full_parameter_bytes():
    def accelerator(ds=None, fsdp=None):
        return types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=fsdp))

    ns = types.SimpleNamespace
    assert trl_compat.sharded_backend(accelerator()) is None
    assert trl_compat.sharded_backend(accelerator(ds=ns(zero_stage=2))) is None
    assert trl_compat.sharded_backend(accelerator(ds=ns(zero_stage=3))) == "DeepSpeed ZeRO-3"
    assert trl_compat.sharded_backend(accelerator(fsdp=ns(fsdp_version=2))) == "FSDP2"
    assert trl_compat.sharded_backend(accelerator(fsdp=ns(fsdp_version=1))) == "FSDP1"
    model = torch.nn.Linear(3, 5)  # 15 + 5 float32 = 80 bytes
    assert trl_compat.full_parameter_bytes(model) == 80
    model.weight.ds_numel = 1000  # ZeRO-3: the full size, the tensor itself empty
    assert trl_compat.full_parameter_bytes(model) == 4 * (1000 + 5)
