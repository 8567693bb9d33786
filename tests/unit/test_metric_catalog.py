"""``metric_catalog.METRICS`` covers exactly the ``rollout_corr/*``, ``rollout_async/*`` and ``rollout/*`` keys that
are logged: every key the correction (each IS level, IcePop, batch normalisation, every RS option, RS on the engine
factor), M2PO, the golden trainer runs (policy lag, the ratio split, support matching, routing replay, ...), the
asynchronous generation (``async_generation.ASYNC_METRICS``, the names its code logs; a real asynchronous run's keys
are checked against them in ``tests/features/test_async_pipeline.py``) and the in-process engine
(``metric_catalog.ENGINE_METRICS``, read against its source) produce matches exactly one family, and every family is
produced by one of them (so a family that is never logged, or a key without a family, fails)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.accumulator import Reducers, RolloutCorrAccumulator
from trl_rollout_corr.async_generation import ASYNC_METRICS
from trl_rollout_corr.correction.rejection import RS_OPTIONS
from trl_rollout_corr.metric_catalog import (
    ASYNC_PREFIX,
    ENGINE_METRICS,
    ENGINE_PREFIX,
    METRICS,
    PREFIX,
    MetricFamily,
    family_of,
)
from trl_rollout_corr.modes.decoupled import DecoupledMode

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_trainer"


def _correction_keys() -> set[str]:
    torch.manual_seed(0)
    B, T = 6, 300
    lp = -torch.rand(B, T)
    mu = lp + 0.1 * torch.randn(B, T)
    mask = torch.ones(B, T)
    mask[0, 70:] = 0
    mask[1, 5:] = 0
    thresholds = {"k1": "0.5_2.0", "k2": "0.1", "k3": "0.1", "binary_kl": "0.1"}
    all_rs = dict(rollout_rs=",".join(RS_OPTIONS),
                  rollout_rs_threshold=",".join(thresholds[o.rsplit("_", 1)[-1] if "binary" not in o else "binary_kl"]
                                                for o in RS_OPTIONS))
    configs = [RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                       **all_rs),
               RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.5_5.0"),
               RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_5.0")]
    keys = set()
    for config in configs:
        keys |= set(compute_rollout_correction(lp, mu, mask, config).metrics)
    engine = RolloutCorrectionConfig(rollout_rs_on="engine", **all_rs)
    keys |= set(compute_rollout_correction(lp, mu, mask, engine, rs_log_probs=lp).metrics)
    keys |= _trainer_m2po_keys(lp, mu, mask)
    return keys


def _trainer_m2po_keys(lp, mu, mask) -> set[str]:
    """The ``rollout_corr/m2po_*`` keys the trainer logs: what ``DecoupledMode._m2po_keep`` (the trainer's one M2PO
    step) records into the trainer's accumulator, flushed as ``RolloutCorrGRPOTrainer.log`` flushes it (not
    ``M2Selection.metrics()``, which the trainer never logs)."""
    metrics = RolloutCorrAccumulator(Reducers())
    trainer = types.SimpleNamespace(rollout_corr_reducers=Reducers(), rollout_corr_metrics=metrics,
                                    metrics_mode="train", accelerator=types.SimpleNamespace(process_index=0))
    DecoupledMode._m2po_keep(types.SimpleNamespace(m2_threshold=1e-3), trainer, lp, mu, mask, None)
    return set(metrics.flush("train"))


def _golden_keys() -> set[str]:
    keys = set()
    for path in GOLDEN.rglob("*.json"):
        keys |= {k for k in _walk_keys(json.loads(path.read_text())) if k.startswith(PREFIX)}
    return keys


def _walk_keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _walk_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_keys(v)


def test_every_logged_key_has_exactly_one_family_and_every_family_is_logged():
    from trl_rollout_corr.features.empty_steps import METRIC as SKIPPED

    keys = _correction_keys() | _golden_keys() | {SKIPPED} | set(ASYNC_METRICS) | set(ENGINE_METRICS)
    assert len(keys) > 250
    problems = {k: [m.pattern for m in family_of(k)] for k in keys if len(family_of(k)) != 1}
    assert problems == {}, "keys with no family or several (add or narrow one in metric_catalog.METRICS)"
    unseen = [m.pattern for m in METRICS if not any(m.matches(k) for k in keys)]
    assert unseen == [], "families no run logs"


def test_patterns_match_as_declared():
    by_pattern = {m.pattern: m for m in METRICS}
    rs = by_pattern["rollout_rs_{option}_{mean,std,max,min,fraction_high,fraction_low}"]
    assert rs.matches("rollout_corr/rollout_rs_seq_mean_k3_mean") and rs.matches("rollout_rs_token_binary_kl_max")
    assert not rs.matches("rollout_rs_seq_mean_k3_seq_mean") and not rs.matches("rollout_rs_seq_mean_k4_mean")
    assert not rs.matches("rollout_rs_engine_seq_mean_k3_mean")
    length = by_pattern["len_{lo}_{hi}/num_seqs"]
    assert length.matches("len_0_64/num_seqs") and length.matches("len_1024_inf/num_seqs")
    assert not length.matches("len_0_64/kl") and not length.matches("len_a_64/num_seqs")
    assert by_pattern["routing_mismatch_fraction/layer_{i}"].matches("routing_mismatch_fraction/layer_12")
    assert family_of("rollout_corr/m2po_masked_tokens") == []  # M2Selection.metrics() only: the trainer never logs it
    assert family_of("rollout_corr/not_a_metric") == []
    # a key is matched under its own prefix only: the two prefixes never share a key
    version = by_pattern["version"]
    assert version.prefix == ASYNC_PREFIX and version.matches("rollout_async/version") and version.matches("version")
    assert family_of("rollout_corr/version") == [] and family_of("rollout_async/kl") == []
    assert [m.listed for m in family_of("rollout_async/generate_s")] == ["rollout_async/generate_s"]
    assert [m.listed for m in family_of("rollout_corr/kl")] == ["kl"]


def test_async_metrics_are_the_async_families():
    """The names ``async_generation`` logs are exactly the catalogue's ``rollout_async/*`` families, one each."""
    assert ASYNC_METRICS == ("rollout_async/trainer_wait_s", "rollout_async/engine_idle_s", "rollout_async/generate_s",
                             "rollout_async/version", "rollout_async/publish_s")
    async_families = [m for m in METRICS if m.prefix == ASYNC_PREFIX]
    assert [[m.listed for m in family_of(k)] for k in ASYNC_METRICS] == [[k] for k in ASYNC_METRICS]
    assert sorted(m.listed for m in async_families) == sorted(ASYNC_METRICS)
    assert {m.family for m in async_families} == {"Asynchronous generation"}


def test_a_family_with_an_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="metric_catalog.PREFIXES"):
        MetricFamily("x", "Trainer features", "x", "x.py", prefix="train/")


def test_the_in_process_engines_timings_are_catalogued_under_their_own_prefix():
    """``VLLMCPURollout``'s ``rollout/*`` keys: each its own family under ``ENGINE_PREFIX``, and the engine's source
    logs exactly these (a key renamed there without ``ENGINE_METRICS`` fails here)."""
    import re

    source = (Path(__file__).resolve().parents[2] / "trl_rollout_corr" / "engines" / "vllm_cpu_rollout.py").read_text()
    logged = set(re.findall(r'log_trl_metric\(trainer, "(rollout/[a-z_]+)"', source))
    assert logged == set(ENGINE_METRICS) == {"rollout/vllm_generate_s", "rollout/vllm_async_wait_s",
                                             "rollout/vllm_sync_s"}
    assert [[m.listed for m in family_of(k)] for k in ENGINE_METRICS] == [[k] for k in ENGINE_METRICS]
    assert all(m.prefix == ENGINE_PREFIX for k in ENGINE_METRICS for m in family_of(k))
    assert family_of("rollout_corr/vllm_sync_s") == [] and family_of("rollout/kl") == []
