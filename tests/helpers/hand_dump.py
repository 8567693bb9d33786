"""A hand-made rollout dump (tests of analyze and the CLI): one decoupled step of two rows whose engine ratios
pi_old / mu are [1, 3, 1] and [0.5, 1], logged with the values the trainer computes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from trl_rollout_corr.accumulator import exact_ratio_quantiles
from trl_rollout_corr.config import RolloutCorrectionConfig
from trl_rollout_corr.correction import compute_rollout_correction
from trl_rollout_corr.records import MicroBatch, RolloutRecordWriter

LN = math.log
# Two rows of one generation batch: pi_old / mu = [1, 3, 1] and [0.5, 1] (one padding position in row 1).
MU = torch.tensor([[LN(0.5), LN(0.5), LN(0.5)], [LN(0.25), LN(0.25), 0.0]])
OLD = MU + torch.tensor([[0.0, LN(3.0), 0.0], [LN(0.5), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
TRAINED = RolloutCorrectionConfig.decoupled_token_is(threshold=2.0)


def hand_dump(path: Path, logged: Optional[dict] = None) -> Path:
    """A decoupled dump of one step with the rows above (pi_theta = pi_old: ratio 1 updates), logged with the
    values the trainer computes for TRAINED (or ``logged``)."""
    w = RolloutRecordWriter(path, eos_token_ids=[1], pad_token_id=0, max_completion_length=3)
    w.write_run_metadata({
        "schema": "trl-rollout-corr/rollout-records", "schema_version": "1.0",
        "correction": {**TRAINED.to_dict(), "mode": "decoupled", "length_buckets": [2, 3],
                       "rollout_corr_preset": "decoupled_token_is"},
        "trainer": {"per_device_train_batch_size": 2, "steps_per_generation": 1}, "model": {}, "engine": {},
    })
    out = compute_rollout_correction(OLD, MU, MASK, TRAINED, length_buckets=(2, 3))
    w.add(MicroBatch(step=0, generation_step=0, generation_batch=0, prompt_ids=torch.tensor([[2], [2]]),
                     prompt_mask=torch.ones(2, 1), completion_ids=torch.tensor([[5, 6, 1], [7, 1, 0]]),
                     completion_mask=MASK, rollout_log_probs=MU, advantages=torch.tensor([1.0, -1.0]),
                     generation_row=torch.tensor([0, 1]),
                     per_token=dict(old_log_probs=OLD, log_probs=OLD, rollout_is_weights=out.weights,
                                    rollout_rs_mask=out.response_mask)))
    metrics = dict(out.metrics)
    metrics.update({f"rollout_corr/{n}_ratio_{q}": v for n in ("engine", "update", "direct")
                    for q, v in quantiles(n).items()})
    metrics.update({"rollout_corr/policy_lag_mean": 0.0, "rollout_corr/policy_lag_max": 0.0})
    w.end_window(1, logged if logged is not None else metrics)
    return path


def quantiles(name: str) -> dict:
    """The logged ratio quantiles: pi_theta = pi_old, so update = 1 and direct = engine."""
    valid = MASK.bool()
    engine = (OLD - MU)[valid].double()
    return exact_ratio_quantiles(engine if name in ("engine", "direct") else torch.zeros_like(engine))


def random_dump(path: Path, rows: int = 48, width: int = 24, noise: float = 0.1, seed: int = 0,
                stale_rows: int = 0) -> Path:
    """A decoupled dump of one step of ``rows`` random rows (lengths 1..``width``, mu = -Exp(1) per token, pi_old =
    mu + N(0, ``noise``^2): continuous statistics, so no ties), trained with token TIS 2.0 + seq_mean_k3 0.01 and
    logged with the values the trainer computes (the ``analyze`` check passes on it). ``stale_rows``: the first rows
    are of policy version 0 at generation step 2 (lag 2) with ``max_policy_lag`` 1, so the trainer dropped them from
    the correction; the others are of version 2 (lag 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    mu = torch.where(mask > 0, -torch.empty(rows, width).exponential_(1.0, generator=g), 0.0)
    old = torch.where(mask > 0, mu + noise * torch.randn(rows, width, generator=g), 0.0)
    trained = RolloutCorrectionConfig.from_preset("decoupled_k3_rs_token_tis")
    w = RolloutRecordWriter(path, eos_token_ids=[1], pad_token_id=0, max_completion_length=width)
    w.write_run_metadata({
        "schema": "trl-rollout-corr/rollout-records", "schema_version": "1.0",
        "correction": {**trained.to_dict(), "mode": "decoupled", "length_buckets": [8, 16],
                       "rollout_corr_preset": "decoupled_k3_rs_token_tis"},
        "trainer": {"per_device_train_batch_size": rows, "steps_per_generation": 1,
                    **({"max_policy_lag": 1} if stale_rows else {})}, "model": {}, "engine": {},
    })
    versions = torch.full((rows,), 2 if stale_rows else 0, dtype=torch.int64)
    versions[:stale_rows] = 0
    kept_rows = (versions == versions.max()).long()
    out = compute_rollout_correction(old, mu, mask * kept_rows[:, None], trained, length_buckets=(8, 16))
    ids = torch.where(mask > 0, torch.randint(2, 50, (rows, width), generator=g), 0)
    ids[torch.arange(rows), lengths - 1] = 1  # every row ends with EOS
    step = 2 if stale_rows else 0
    w.add(MicroBatch(step=step, generation_step=step, generation_batch=0, prompt_ids=torch.full((rows, 1), 2),
                     prompt_mask=torch.ones(rows, 1), completion_ids=ids, completion_mask=mask,
                     rollout_log_probs=mu, advantages=torch.zeros(rows), generation_row=torch.arange(rows),
                     policy_version=versions if stale_rows else None,
                     per_token=dict(old_log_probs=old, log_probs=old, rollout_is_weights=out.weights,
                                    rollout_rs_mask=out.response_mask)))
    kept = out.response_mask > 0
    engine = (old - mu)[kept].double()
    metrics = dict(out.metrics)
    metrics.update({f"rollout_corr/{n}_ratio_{q}": v for n in ("engine", "update", "direct")
                    for q, v in exact_ratio_quantiles(torch.zeros_like(engine) if n == "update" else engine).items()})
    if not stale_rows:
        metrics.update({"rollout_corr/policy_lag_mean": 0.0, "rollout_corr/policy_lag_max": 0.0})
    w.end_window(step + 1, metrics)
    return path


# A stale decoupled step for RS on the engine factor (records 1.1 with version_log_probs): mu = -1 everywhere, the
# engine factor e = log pi_train@v - log mu and the lag factor g = log pi_old - log pi_train@v per token. Rows 0 and
# 1 are of the current version 2 (lag 0: pi_train@v = pi_old), row 2 of version 1 (lag 1, stale by 1 nat per token),
# row 3 of version 0 (lag 2 > max_policy_lag 1: the trainer dropped it from the correction).
LAG_ENGINE = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0], [0.05, 0.15, 0.25], [2.0, 2.0, 2.0]])
LAG_LAG = torch.tensor([[0.0] * 3, [0.0] * 3, [1.0] * 3, [3.0] * 3])
LAG_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
LAG_VERSIONS = torch.tensor([2, 2, 1, 0])


def lag_dump(path: Path, trained: RolloutCorrectionConfig = TRAINED) -> Path:
    """A decoupled dump (records 1.1) of one step at generation step 2 with the rows above and their
    ``version_log_probs`` (policy_lag_split), ``max_policy_lag`` 1, trained with ``trained`` (default TRAINED; RS on
    the engine factor gets pi_train@v as ``rs_log_probs``) on the rows within the bound and logged with the values
    the trainer computes (the ``analyze`` check passes on it)."""
    mu = torch.full((4, 3), -1.0)
    version = mu + LAG_ENGINE
    old = version + LAG_LAG
    w = RolloutRecordWriter(path, eos_token_ids=[1], pad_token_id=0, max_completion_length=3)
    w.write_run_metadata({
        "schema": "trl-rollout-corr/rollout-records", "schema_version": "1.1",
        "correction": {**trained.to_dict(), "mode": "decoupled", "length_buckets": [2, 3],
                       "rollout_corr_preset": "decoupled_token_is" if trained == TRAINED else None},
        "trainer": {"per_device_train_batch_size": 4, "steps_per_generation": 1, "max_policy_lag": 1,
                    "policy_lag_split": True}, "model": {}, "engine": {},
    })
    kept_rows = (LAG_VERSIONS >= 1).long()
    engine = trained.rs_enabled and trained.rollout_rs_on == "engine"
    out = compute_rollout_correction(old, mu, LAG_MASK * kept_rows[:, None], trained, length_buckets=(2, 3),
                                     rs_log_probs=version if engine else None)
    w.add(MicroBatch(step=2, generation_step=2, generation_batch=0, prompt_ids=torch.full((4, 1), 2),
                     prompt_mask=torch.ones(4, 1), completion_ids=torch.tensor([[5, 6, 1], [7, 1, 0], [5, 5, 1],
                                                                                [6, 6, 1]]),
                     completion_mask=LAG_MASK, rollout_log_probs=mu, advantages=torch.zeros(4),
                     generation_row=torch.arange(4), policy_version=LAG_VERSIONS,
                     per_token=dict(old_log_probs=old, log_probs=old, version_log_probs=version,
                                    rollout_is_weights=out.weights, rollout_rs_mask=out.response_mask)))
    w.end_window(3, dict(out.metrics))
    return path
