"""``policy_lag_split``'s version store and version set (issue 46), in one process: the shard store swaps a kept
version into the live model and back bit for bit, and the stale versions are the union over ranks (the other rank
faked by the reducer), so every rank runs the same version forwards and keeps the same versions. The real 2-rank runs
on ZeRO-3 and FSDP2 are in ``tests/test_sharded.py``."""

from __future__ import annotations

import types

import pytest
import torch

from tiny_model import make_tiny_model
from trl_rollout_corr.accumulator import Reducers
from trl_rollout_corr.features.lag_split import LagSplit
from trl_rollout_corr.version_store import FullCopies, RankShards, store_for

pytestmark = pytest.mark.unit


def _trainer(model=None, deepspeed=None, fsdp=None, other_rank=None):
    """A stand-in trainer: accelerate's state (backend plugins), the model, and a max all-reduce with one other
    rank whose tensor is ``other_rank`` (None: one process)."""
    state = types.SimpleNamespace(deepspeed_plugin=deepspeed, fsdp_plugin=fsdp)
    accelerator = types.SimpleNamespace(state=state, unwrap_model=lambda m: m)
    reducers = Reducers() if other_rank is None else Reducers(
        world_size=2, max=lambda t: torch.maximum(t, other_rank(t)))
    return types.SimpleNamespace(accelerator=accelerator, model=model, rollout_corr_reducers=reducers,
                                 args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
                                 state=types.SimpleNamespace(global_step=2), metrics_mode="train")


def test_store_by_backend_and_refusals():
    ns = types.SimpleNamespace
    assert isinstance(store_for(_trainer()), FullCopies)
    assert isinstance(store_for(_trainer(deepspeed=ns(zero_stage=2, deepspeed_config={}))), FullCopies)
    zero3 = store_for(_trainer(deepspeed=ns(zero_stage=3, deepspeed_config={"zero_optimization": {"stage": 3}})))
    assert isinstance(zero3, RankShards) and zero3.collective
    assert isinstance(store_for(_trainer(fsdp=ns(fsdp_version=2))), RankShards)
    with pytest.raises(NotImplementedError, match="not supported on FSDP1"):
        store_for(_trainer(fsdp=ns(fsdp_version=1)))
    for zero in ({"offload_param": {"device": "nvme"}}, {"zero_hpz_partition_size": 8}):
        with pytest.raises(NotImplementedError, match="offload_param on NVMe or hpZ"):
            store_for(_trainer(deepspeed=ns(zero_stage=3, deepspeed_config={"zero_optimization": zero})))


def test_rank_shards_swap_a_version_in_and_back_bit_for_bit():
    """A parameter no backend shards is its own shard: the kept version is in the live model inside ``loaded``,
    the current weights are back, bit for bit, after it (also after an error inside); one version's bytes are the
    model's."""
    model, _ = make_tiny_model("llama", seed=0)
    trainer = _trainer(model)
    store = RankShards("test")
    kept = store.keep(trainer)
    version0 = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # "training"
    current = [p.detach().clone() for p in model.parameters()]
    assert store.kept_bytes(kept) == sum(p.numel() * 4 for p in model.parameters())
    ids = torch.tensor([[5, 6, 7, 8]])
    with store.loaded(trainer, kept) as live:
        assert live is model
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(), version0))
        at_version0 = model(ids).logits
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), current))
    with pytest.raises(RuntimeError, match="boom"):
        with store.loaded(trainer, kept):
            raise RuntimeError("boom")
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), current))
    with store.loaded(trainer, kept):  # the kept version itself is unchanged by the swaps
        assert torch.equal(model(ids).logits, at_version0)


def test_stale_versions_are_the_union_over_ranks():
    """This rank holds no stale rows, the other rank rows of version 1 (and the oldest row, 1): this rank still runs
    version 1's forward and drops only version 0; a version another rank has but no rank holds fails on every rank.
    Before the fix each rank ran (and pruned by) its own rows only: a hang on a sharded model."""
    lag = LagSplit.__new__(LagSplit)
    lag.store, lag.weights, lag._oldest = RankShards("test"), {0: [], 1: [], 2: []}, None

    def other(t):  # the other rank: stale rows of version 1 only, oldest row version 1, nothing missing
        out = torch.zeros_like(t)
        out[1], out[-1] = 1, -1
        return out

    trainer = _trainer(other_rank=other)
    assert lag._stale_versions(trainer, set(), 2) == [1]
    assert lag._oldest == 1
    assert lag._stale_versions(_trainer(), set(), 2) == [] and lag._oldest == 2  # one process: its own rows

    def missing(t):
        out = torch.zeros_like(t)
        out[-2], out[-1] = 1, -2
        return out

    with pytest.raises(ValueError, match="another rank got rows of a version"):
        lag._stale_versions(_trainer(other_rank=missing), set(), 2)
    with pytest.raises(ValueError, match="rows of version 7 arrived"):
        lag._stale_versions(_trainer(), {7}, 2)
