"""Feature triples under stale rollouts (issue 22's follow-up): ``test_combinations`` trains every feature pair at lag
0 only, so the weights-at-version forward, the lag drops and the lag ratio are never exercised together. Here each
combination trains 4 steps on a tiny float32 model with a stale ``transformers.generate`` engine
(``stale_rollout.StaleRollout``, sync interval 3: lags 0, 1, 2, 0), three times: micro-batch 8 x accumulation 1 with
``rollout_corr_old_forward`` "auto" and "always" (decoupled only: bypass has no pi_old forward), and micro-batch
4 x accumulation 2 ("auto"). The invariants:

* micro-batch 8 x 1 and 4 x 2 are one optimizer step over the same 8 rows: grad norm and loss agree to 1e-5
  (relative; the loss also to 2e-6 absolute: it sums zero-mean-advantage terms, so float32 summation order moves
  it by up to ~1e-6; a wrong normaliser moves either by > 1e-2);
* the pi_old elision ("auto" at micro-batch 8 x 1, where it applies) trains like the kept forward ("always"): grad
  norm, loss and every logged ``rollout_corr/*`` value to 1e-6;
* float32 on both sides and truthful versions: with ``policy_lag_split`` every ``engine_ratio_*`` is 1 to 1e-5 on
  the stale steps too (pi_train@v is the engine), and the staleness shows in the lag ratio;
* no NaN in any logged value;
* the logged lag statistics are the versions the engine reported, the dropped fraction is the fraction of rows over
  ``max_policy_lag`` (without ``policy_lag_split`` every even row reports one version newer, so some steps drop
  half their rows), and a step whose rows are all dropped trains nothing (loss and grad norm 0).
"""

from __future__ import annotations

import math

import pytest

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("_silence_trl_experimental")]

ENGINE_KEYS = [f"rollout_corr/engine_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]
MODES = {"decoupled": dict(rollout_corr_preset="decoupled_token_is"),
         "bypass": dict(rollout_corr_preset="bypass_pg_is")}
FEATURES = {
    "support_recompute": dict(rollout_support_matching="recompute", top_p=0.8),
    "routing_r3": dict(routing_replay="r3", router_aux_loss_coef=0.0),  # aux loss: a micro-batch statistic
    "policy_lag_split": dict(policy_lag_split=True),
    "max_policy_lag": dict(max_policy_lag=1),
    "batch_norm": dict(rollout_is_batch_normalize=True),
    "num_iterations_2": dict(num_iterations=2),
    "m2po": dict(rollout_m2_threshold=0.01),
    "rs_engine": dict(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_on="engine"),
}
TRIPLES = [
    ("decoupled", ("policy_lag_split", "support_recompute", "routing_r3")),
    ("bypass", ("batch_norm", "max_policy_lag", "support_recompute")),
    ("decoupled", ("policy_lag_split", "num_iterations_2", "routing_r3")),
    ("decoupled", ("max_policy_lag", "routing_r3", "batch_norm")),
    ("decoupled", ("policy_lag_split", "max_policy_lag", "batch_norm")),
    ("decoupled", ("max_policy_lag", "num_iterations_2", "batch_norm")),
    ("bypass", ("routing_r3", "max_policy_lag", "num_iterations_2")),
    ("decoupled", ("max_policy_lag", "support_recompute", "batch_norm")),
    ("decoupled", ("m2po", "max_policy_lag", "routing_r3")),
    ("decoupled", ("rs_engine", "policy_lag_split", "max_policy_lag")),
]
SHAPES = ((8, 1, "auto"), (8, 1, "always"), (4, 2, "auto"))  # micro-batch, accumulation, rollout_corr_old_forward


class Reporting(StaleRollout):
    """``StaleRollout`` that keeps the versions it reported, one list per call (``reported``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reported: list[list[int]] = []

    def __call__(self, prompts, trainer):
        out = self.report_versions(super().__call__(prompts, trainer), int(trainer.state.global_step))
        self.reported.append(list(out["policy_version"]))
        return out

    def report_versions(self, out, step):
        return out


class HalfFresher(Reporting):
    """Every even row reports one version newer than it is (never ahead of the trainer): on the step where the
    engine is 2 steps stale, half the rows are lag 1 (kept by max_policy_lag=1) and half lag 2 (dropped)."""

    def report_versions(self, out, step):
        out["policy_version"] = [v + 1 if i % 2 == 0 and v + 1 <= step else v
                                 for i, v in enumerate(out["policy_version"])]
        return out


def _train(model_dir, tmp_path, mode, features, shape):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    mb, ga, old_forward = shape
    overrides = dict(MODES[mode], per_device_train_batch_size=mb, gradient_accumulation_steps=ga,
                     rollout_corr_old_forward=old_forward, loss_type="grpo")
    for f in features:
        overrides.update(FEATURES[f])
    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "num_generations": 4, "max_completion_length": 8, "max_steps": 4,
        "logging_steps": 1, "report_to": [], "use_cpu": True, "learning_rate": 1e-3, "save_strategy": "no",
        "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False, **overrides})
    # policy_lag_split needs truthful versions (pi_train@v is then the engine); the others get partial drops
    engine = Reporting if "policy_lag_split" in features else HalfFresher
    rollout = engine(sync_interval=3, top_p=0.8 if "support_recompute" in features else 1.0,
                     routes="routing_r3" in features)
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=rollout)
    trainer.train()
    return rollout, [h for h in trainer.state.log_history if "loss" in h]


def _check_run(mode, features, rollout, logs, shape):
    assert len(logs) == 4
    for log in logs:
        bad = [k for k, v in log.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, (shape, log["step"], bad)
    for i, log in enumerate(logs):
        # a row's lag is the trainer's step minus its reported version (num_iterations 2: the buffered batch trained
        # again at the next step is one step older)
        lags = [i - v for v in rollout.reported[i // 2 if "num_iterations_2" in features else i]]
        assert log["rollout_corr/policy_lag_max"] == max(lags), (shape, log["step"], rollout.reported)
        if "max_policy_lag" in features:
            dropped = sum(lag > 1 for lag in lags) / len(lags)
            assert log["rollout_corr/policy_lag_dropped_fraction"] == pytest.approx(dropped), (shape, log["step"])
            if dropped == 1.0:  # nothing left to train on
                assert log["grad_norm"] == 0.0 and log["loss"] == 0.0, (shape, log["step"], log["grad_norm"])
    if "m2po" in features:  # logged on every step that trained a token; the step-global mask masks some token
        for log in logs:
            trained = log["rollout_corr/policy_lag_dropped_fraction"] < 1.0
            assert ("rollout_corr/m2po_masked_fraction" in log) == trained, (shape, log["step"])
        assert any(log.get("rollout_corr/m2po_masked_fraction", 0.0) > 0 for log in logs), shape
    if "max_policy_lag" in features and "policy_lag_split" not in features:  # the half-fresher engine
        assert any(0.0 < log["rollout_corr/policy_lag_dropped_fraction"] < 1.0 for log in logs), shape
    if "policy_lag_split" in features:
        # a step whose rows are all dropped logs no ratio statistic (absent, never 0): only the trained steps have them
        for log in logs:
            if log.get("rollout_corr/policy_lag_dropped_fraction", 0.0) == 1.0:
                assert not any(k in log for k in ENGINE_KEYS), (shape, log["step"])
        trained = [log for log in logs if log.get("rollout_corr/policy_lag_dropped_fraction", 0.0) < 1.0]
        stale = [log for log in trained if log["rollout_corr/policy_lag_max"] > 0]
        assert stale, "no stale step trained"
        for log in trained:
            for key in ENGINE_KEYS:
                assert abs(log[key] - 1.0) < 1e-5, (shape, log["step"], key, log[key])
        assert max(abs(log["rollout_corr/lag_ratio_max"] - 1.0) for log in stale) > 1e-3


@pytest.mark.parametrize("mode,features", TRIPLES, ids=["-".join((m, *f)) for m, f in TRIPLES])
def test_stale_triple(mode, features, llama_dir, qwen3_moe_dir, tmp_path):
    from conftest import _make_args

    # bypass has no pi_old forward to keep (pi_old := mu): "always" is refused there (BypassMode.check_config)
    shapes = [s for s in SHAPES if not (mode == "bypass" and s[2] == "always")]
    for shape in shapes:  # every triple here is accepted by the config
        _make_args(tmp_path, **dict(MODES[mode], per_device_train_batch_size=shape[0],
                                    gradient_accumulation_steps=shape[1], rollout_corr_old_forward=shape[2],
                                    **{k: v for f in features for k, v in FEATURES[f].items()}))
    model_dir = qwen3_moe_dir if "routing_r3" in features else llama_dir
    runs = {}
    for shape in shapes:
        rollout, logs = _train(model_dir, tmp_path / "-".join(map(str, shape)), mode, features, shape)
        _check_run(mode, features, rollout, logs, shape)
        runs[shape] = logs
    whole, kept, split = (runs.get(s) for s in SHAPES)
    for a, b, c in zip(whole, kept or whole, split):
        step = a["step"]
        assert set(a) == set(b) == set(c), ("same logged keys", step, set(a) ^ set(b), set(a) ^ set(c))
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=1e-7), ("4x2 vs 8x1", step)
        # the loss is a sum of zero-mean-advantage terms (cancellation): its float32 noise is ~1e-6 absolute
        assert c["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=2e-6), ("4x2 vs 8x1", step)
        if kept is None:
            continue
        for key in sorted(k for k in a if k.startswith("rollout_corr/")):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), ("always vs auto", step, key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6, abs=1e-7), ("always vs auto", step)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), ("always vs auto", step)
