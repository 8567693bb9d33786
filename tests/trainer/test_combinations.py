"""The feature-combination matrix (issue 22): every pair of {decoupled, bypass} x {support recompute, routing replay
r3, policy_lag_split, max_policy_lag, records, batch norm with accumulation, num_iterations 2, M2PO, RS on the engine
factor (issue 23)} that the config accepts trains 2 steps on a tiny model (a tiny Qwen3-MoE, router aux loss off,
where r3 is in the pair, else the tiny Llama), float32 on both sides and lag 0 (``transformers.generate`` samples
from the policy itself), twice: micro-batch 1 x accumulation 4 and micro-batch 4 x accumulation 1. The invariants
every combination must keep:

* the two micro-batchings are one optimizer step: grad norm and loss agree to 1e-4 (absolute; the runs differ only
  in float32 summation order over a 2-layer model, measured differences are ~1e-6; a wrong normaliser or a
  per-micro-batch statistic moves them by > 1e-2, e.g. issue 9's 27.04 vs 29.10);
* float32 on both sides at lag 0: every logged ``engine_ratio_*`` is 1 to 1e-5;
* no NaN in any logged value;
* with records on: ``analyze`` reproduces every logged ``rollout_corr/*`` value it recomputes (its default
  tolerance) and names the others (``not_recomputed``), which must be the feature's known set (routing_* with R3:
  they need the trainer's own top-k); a dump it refuses (RS on the engine factor) must be refused naming the setting.

The combinations the config refuses are in docs/reference/combinations.md, checked against the refusals here
(regenerate
with ``COMBINATIONS_REGENERATE=1``). Runtime: see the README (about 2 minutes on one core for the whole file).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from pathlib import Path

import pytest

from tiny_model import make_tiny_model_dir

MODES = {
    "decoupled": dict(rollout_corr_preset="decoupled_token_is"),
    "bypass": dict(rollout_corr_preset="bypass_pg_is"),
}
# feature name -> config overrides ("records" gets its dump directory per run)
FEATURES = {
    "support_recompute": dict(rollout_support_matching="recompute", top_p=0.8),
    # the router's load-balancing loss is a statistic of the micro-batch (micro-batch 1 x 4 and 4 x 1 are different
    # objectives with it): off, so the micro-batching invariant holds on the MoE
    "routing_r3": dict(routing_replay="r3", router_aux_loss_coef=0.0),
    "policy_lag_split": dict(policy_lag_split=True),
    "max_policy_lag": dict(max_policy_lag=1),
    "records": dict(),
    "batch_norm_accum": dict(rollout_is_batch_normalize=True),
    "num_iterations_2": dict(num_iterations=2),
    # issue 23: M2PO's step-global mask (tau 0.04 masks nothing at lag 0 in float32: the wiring must not change the
    # step) and RS on the engine factor (its own lag split and RS option)
    "m2po": dict(rollout_m2_threshold=0.04),
    "rs_engine": dict(policy_lag_split=True, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01,
                      rollout_rs_on="engine"),
}
SHAPES = ((1, 4), (4, 1))  # (per_device_train_batch_size, gradient_accumulation_steps)
ENGINE_KEYS = [f"rollout_corr/engine_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]
# logged keys analyze does not recompute, by the feature that logs them
NOT_RECOMPUTED = {  # policy_lag_split's lag_ratio_* are recomputed from version_log_probs (issue 22)
    "routing_r3": {"rollout_corr/routing_mismatch_fraction", "rollout_corr/routing_token_mismatch_fraction",
                   "rollout_corr/routing_mismatch_fraction/layer_0", "rollout_corr/routing_mismatch_fraction/layer_1"},
}
# a dump analyze refuses, and the setting its message must name (support matching and max_policy_lag: recorded)
ANALYZE_REFUSES = {"m2po": "rollout_m2_threshold=0.04 (M2PO)"}
DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "combinations.md"
TABLE_START, TABLE_END = "<!-- refused-combinations:start -->", "<!-- refused-combinations:end -->"
PAIRS = [(mode, a, b) for mode in MODES for a, b in itertools.combinations(FEATURES, 2)]


@pytest.fixture(scope="module")
def moe_no_aux_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2, scaled routers: ``tiny_model``)."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), "qwen3_moe", seed=0)


def _overrides(mode: str, features: tuple, shape: tuple, dump_dir=None) -> dict:
    mb, ga = shape
    out = dict(MODES[mode], per_device_train_batch_size=mb, gradient_accumulation_steps=ga, max_steps=2,
               loss_type="grpo")
    for f in features:
        out.update(FEATURES[f])
    if "records" in features and dump_dir is not None:
        out["rollout_dump_dir"] = str(dump_dir)
    return out


def _refusal(mode: str, features: tuple, tmp_path) -> str | None:
    """The config's refusal message for this combination (under either micro-batching), or None."""
    from conftest import _make_args

    messages = set()
    for shape in SHAPES:
        try:
            _make_args(tmp_path, **_overrides(mode, features, shape, tmp_path / "dump"))
        except ValueError as e:
            messages.add(str(e).splitlines()[0])
    return " / ".join(sorted(messages)) or None


def refused_table(tmp_path) -> str:
    """The Markdown list of the refused pairs (one item each: mode, features, the config's message), wrapped at the
    docs' 120 columns."""
    import textwrap

    lines = []
    for mode, a, b in PAIRS:
        msg = _refusal(mode, (a, b), tmp_path)
        if msg is not None:
            lines += textwrap.wrap(f"{mode}, {a} + {b}: {msg}", 120, initial_indent="* ", subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def test_refused_combinations_table_is_the_docs_table(tmp_path):
    table = refused_table(tmp_path)
    text = DOC.read_text() if DOC.exists() else ""
    if os.environ.get("COMBINATIONS_REGENERATE") == "1":
        head, _, rest = text.partition(TABLE_START)
        _, _, tail = rest.partition(TABLE_END)
        DOC.write_text(f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}")
        text = DOC.read_text()
    found = re.search(re.escape(TABLE_START) + r"\n(.*?)\n" + re.escape(TABLE_END), text, re.S)
    assert found, f"{DOC} has no refused-combinations table; run with COMBINATIONS_REGENERATE=1"
    assert found.group(1) == table, f"{DOC} is stale; regenerate with COMBINATIONS_REGENERATE=1"
    assert table.count("\n* ") >= 2  # some pairs are refused (bypass + policy_lag_split at least)


def _train(model_dir, tmp_path, mode, features, shape):
    from conftest import _make_trainer

    trainer = _make_trainer(model_dir, tmp_path, **_overrides(mode, features, shape, tmp_path / "dump"))
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("mode,a,b", PAIRS, ids=[f"{m}-{a}-{b}" for m, a, b in PAIRS])
def test_combination(mode, a, b, llama_dir, moe_no_aux_dir, tmp_path):
    features = (a, b)
    if _refusal(mode, features, tmp_path) is not None:
        pytest.skip("refused by the config (docs/reference/combinations.md)")
    model_dir = moe_no_aux_dir if "routing_r3" in features else llama_dir
    runs = {}
    for shape in SHAPES:
        trainer, logs = _train(model_dir, tmp_path / f"{shape[0]}x{shape[1]}", mode, features, shape)
        assert len(logs) == 2
        for log in logs:
            bad = [k for k, v in log.items() if isinstance(v, float) and math.isnan(v)]
            assert not bad, (shape, log["step"], bad)
            for key in ENGINE_KEYS:
                if key in log:
                    assert abs(log[key] - 1.0) <= 1e-5, (shape, log["step"], key, log[key])
            if mode == "decoupled":
                assert all(key in log for key in ENGINE_KEYS), sorted(log)
        runs[shape] = (trainer, logs)
    for small, whole in zip(runs[(1, 4)][1], runs[(4, 1)][1]):
        assert small["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4), small["step"]
        assert small["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-6), small["step"]
        factor = "rollout_corr/rollout_is_batch_norm_factor"
        if factor in whole:
            assert small[factor] == pytest.approx(whole[factor], rel=1e-5)
    if "records" in features:
        _check_analyze(features, runs)


def _check_analyze(features, runs):
    from trl_rollout_corr.analyze import ConfigError, analyse_dump
    from trl_rollout_corr.records import open_dump

    for shape, (trainer, logs) in runs.items():
        dump = open_dump(Path(trainer.args.output_dir).parent / "dump")
        refused_by = [f for f in features if f in ANALYZE_REFUSES]
        if refused_by:
            with pytest.raises(ConfigError, match=re.escape(ANALYZE_REFUSES[refused_by[0]])):
                analyse_dump(dump, [])
            continue
        check, _, _ = analyse_dump(dump, [])
        assert check.ok and not check.skipped, (shape, check.failures[:3], check.skipped)
        expected = set().union(*(NOT_RECOMPUTED.get(f, set()) for f in features))
        logged = {k for log in logs for k in log if k.startswith("rollout_corr/")}
        assert check.not_recomputed == expected & logged, shape
        assert check.compared >= 10 * len(logs)
