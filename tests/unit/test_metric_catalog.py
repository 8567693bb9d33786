"""``metric_catalog.METRICS`` covers exactly the ``rollout_corr/*`` keys that are logged: every key the correction
(each IS level, IcePop, batch normalisation, every RS option, RS on the engine factor), M2PO and the golden trainer
runs (policy lag, the ratio split, support matching, routing replay, ...) produce matches exactly one family, and every
family is produced by one of them (so a family that is never logged, or a key without a family, fails)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.correction.m2po import m2po_mask
from trl_rollout_corr.correction.rejection import RS_OPTIONS
from trl_rollout_corr.metric_catalog import METRICS, PREFIX, family_of

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
    keys |= set(m2po_mask(lp - mu, mask, 1e-3)[1].metrics())
    return keys


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

    keys = _correction_keys() | _golden_keys() | {SKIPPED}
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
    assert family_of("rollout_corr/not_a_metric") == []
