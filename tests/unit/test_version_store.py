"""``policy_lag_split``'s version store and version set (issue 46), in one process: the shard store swaps a kept
version into the live model and back bit for bit, and the stale versions are the union over ranks (the other rank
faked by the reducer), so every rank runs the same version forwards and keeps the same versions. The real 2-rank runs
on ZeRO-3 and FSDP2 are in ``tests/e2e/test_sharded.py``."""

from __future__ import annotations

import collections
import contextlib
import types

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from tiny_model import make_tiny_model
from trl_rollout_corr.accumulator import Reducers
from trl_rollout_corr.features.lag_split import LagSplit
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer
from trl_rollout_corr.version_store import FullCopies, RankShards, store_for


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
    assert lag._stale_versions(trainer, {}, 2) == [(1, 1)]
    assert lag._oldest == 1
    assert lag._stale_versions(_trainer(), {}, 2) == [] and lag._oldest == 2  # one process: its own rows

    def missing(t):
        out = torch.zeros_like(t)
        out[-2], out[-1] = 1, -2
        return out

    with pytest.raises(ValueError, match="another rank got rows of a version"):
        lag._stale_versions(_trainer(other_rank=missing), {}, 2)
    with pytest.raises(ValueError, match="rows of version 7 arrived"):
        lag._stale_versions(_trainer(), {7: 1}, 2)


class _CountingPolicy(torch.nn.Module):
    """Counts its forwards (rows per forward); the log-prob of each token is -(its id) / 100."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, input_ids, attention_mask, labels=None, **kwargs):
        self.calls.append(int(input_ids.shape[0]))
        return types.SimpleNamespace(log_probs=-input_ids.float() / 100)


class _FakeStore:
    """A store whose ``loaded`` yields ``model`` and counts its entries (each a collective on a sharded model)."""

    def __init__(self, model, collective: bool) -> None:
        self.model, self.collective, self.entries = model, collective, []

    @contextlib.contextmanager
    def loaded(self, trainer, kept):
        self.entries.append(kept)
        yield self.model


def _version_rows(versions: list[int], other_chunks: int, collective: bool = True, kept=None, seen=None):
    """``version_log_probs`` of one rank at step 2 (``per_device_train_batch_size`` 2) over rows of ``versions``,
    the other rank faked: ``other_chunks`` forward chunks of version 1's rows, its oldest row version 1; ``kept``:
    the rows' ``rollout_support`` (replay's kept-token sets), each forward's appended to ``seen``. Returns (the
    policy's forward sizes, the store's entries, the batch's completion ids, old log-probs, the result)."""
    policy = _CountingPolicy()
    lag = LagSplit.__new__(LagSplit)
    lag.store, lag.weights, lag._oldest = _FakeStore(policy, collective), {0: "v0", 1: "v1", 2: "v2"}, None

    def other(t):  # held (0, 1, 2), then missing, then -oldest
        out = torch.zeros_like(t)
        out[1], out[-1] = other_chunks, -1
        return out

    trainer = _trainer(other_rank=other)
    trainer.args.per_device_train_batch_size, trainer.args.report_to = 2, []  # TRL's own chunking, profiled
    trainer.accelerator.autocast, trainer.accelerator.is_main_process = contextlib.nullcontext, True
    trainer.rollout_corr_forward_counts = collections.Counter()
    trainer._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies,
                                                                  trainer)
    policy_forward = types.MethodType(RolloutCorrGRPOTrainer.policy_forward, trainer)

    def forward(call, fwd, **kwargs):
        if seen is not None:
            seen.append(call.batch.get("rollout_support"))
        return policy_forward(call, fwd, **kwargs)

    trainer.policy_forward = forward
    n = len(versions)
    completion = torch.arange(3 * n).view(n, 3) + 10
    old = torch.full((n, 3), -5.0)
    batch = {"prompt_ids": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
             "completion_ids": completion, "completion_mask": torch.ones(n, 3, dtype=torch.long),
             "old_per_token_logps": old, "rollout_policy_version": torch.tensor(versions)}
    if kept is not None:
        batch["rollout_support"] = kept
    result = lag.version_log_probs(trainer, batch)
    return policy.calls, lag.store.entries, completion, old, result


def test_every_rank_runs_as_many_model_forwards_per_version():
    """TRL forwards ``per_device_train_batch_size`` rows at a time: this rank's 3 rows of version 1 are 2 model
    forwards, so a rank with none (or 1 row: 1 forward) adds 1-row placeholder forwards, in the same ``loaded``,
    up to the most chunks of any rank; the real rows keep their chunking and values, the placeholders' values are
    discarded. Before the fix a rank without rows ran one placeholder forward: ZeRO-3 / FSDP2 hung (issue: rank 0
    with 4 stale rows ran 2 forwards, rank 1 one)."""
    calls, entries, completion, old, result = _version_rows([1, 1, 2, 1], other_chunks=0)
    assert calls == [2, 1] and entries == ["v1"]  # this rank's rows: 2 chunks, the other rank's 0
    stale = torch.tensor([True, True, False, True])
    assert torch.equal(result[stale], -completion[stale].float() / 100) and torch.equal(result[~stale], old[~stale])

    calls, entries, _, old, result = _version_rows([2, 2, 2, 2], other_chunks=2)  # no rows of version 1 here
    assert calls == [1, 1] and entries == ["v1"] and torch.equal(result, old)

    calls, entries, completion, old, result = _version_rows([1, 2, 2, 2], other_chunks=3)  # 1 row here, 3 chunks there
    assert calls == [1, 1, 1] and entries == ["v1"]
    assert torch.equal(result[0], -completion[0].float() / 100) and torch.equal(result[1:], old[1:])

    calls, entries, _, _, _ = _version_rows([1, 1, 1, 1], other_chunks=1)  # the most chunks here: no placeholder
    assert calls == [2, 2]

    calls, entries, _, old, result = _version_rows([2, 2, 2, 2], other_chunks=2, collective=False)
    assert calls == [] and entries == [] and torch.equal(result, old)  # a whole copy per rank: no collective


def test_the_version_forward_takes_its_rows_kept_token_sets():
    """Support replay scores each row over its engine's kept-token sets (``rollout_support``, a list of B): the
    version forward takes those of its own rows (rows 0 and 2 here), the placeholder row 0's. Before the fix it took
    none (the scorer: "needs the engine's kept-token sets for every row")."""
    seen = []
    calls, _, _, _, _ = _version_rows([1, 2, 1, 2], other_chunks=2, kept=["k0", "k1", "k2", "k3"], seen=seen)
    assert calls == [2, 1] and seen == [["k0", "k2"], ["k0"]]
    seen.clear()
    _version_rows([2, 2, 2, 1], other_chunks=1, kept=["k0", "k1", "k2", "k3"], seen=seen)
    assert seen == [["k3"]]


def test_a_failed_swap_leaves_the_live_weights_and_the_version_bit_for_bit(monkeypatch):
    """A kept shard whose shape no longer fits (the 2nd parameter's) is refused before anything is swapped; an
    error midway through the swap (here the ZeRO-3 refresh after every exchange) undoes the exchanges done. Either
    way the live weights and the kept version are bit-identical to before. Before the fix the first parameter kept
    the version's weights (the first swap ran outside the try, and checked each shape only when it got to it)."""
    from trl_rollout_corr import version_store

    model, _ = make_tiny_model("llama", seed=0)
    trainer = _trainer(model)
    store = RankShards("test")
    kept = store.keep(trainer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # "training": the live weights differ from the version
    current = [p.detach().clone() for p in model.parameters()]
    version = [t.clone() for t in kept]

    def unchanged() -> bool:
        return (all(torch.equal(p, c) for p, c in zip(model.parameters(), current))
                and all(torch.equal(t, v) for t, v in zip(kept, version)))

    wrong = list(kept)
    wrong[1] = kept[1][:-1].clone()  # the 2nd parameter re-partitioned
    with pytest.raises(RuntimeError, match="the backend re-partitioned the model"):
        with store.loaded(trainer, wrong):
            raise AssertionError("never entered")
    assert unchanged() and torch.equal(wrong[0], version[0])

    def failing_refresh(params):
        raise RuntimeError("refresh failed")

    monkeypatch.setattr(version_store, "_refresh_gathered_zero3", failing_refresh)
    with pytest.raises(RuntimeError, match="refresh failed"):
        with store.loaded(trainer, kept):
            raise AssertionError("never entered")
    assert unchanged()
