"""Issue 22's feature-combination bugs, one test each, through the public trainer API on tiny float32 models with a
stale rollout engine (``stale_rollout.StaleRollout``): bypass batch normalisation with ``max_policy_lag`` drops and
gradient accumulation; ``policy_lag_split`` with support matching and with routing replay; ``analyze`` on a
``policy_lag_split`` run with stale rollouts."""

from __future__ import annotations

import math

import pytest

from stale_rollout import StaleRollout
from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

ENGINE_KEYS = [f"rollout_corr/engine_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]


@pytest.fixture(autouse=True)
def _silence_trl_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL


def _train(model_dir, tmp_path, rollout, **overrides):
    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "learning_rate": 1e-3, "save_strategy": "no", "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False,
        "rollout_corr_preset": "decoupled_token_is", **overrides})
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=rollout)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


class _HalfFresher(StaleRollout):
    """Sync interval 3, but every even row reports one version newer than it is (never ahead of the trainer): on the
    step where the engine is 2 steps stale, half the rows are lag 1 (kept by max_policy_lag=1) and half lag 2
    (dropped), and the kept rows' IS weights are not 1 (their mu is 2 steps stale)."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        step = int(trainer.state.global_step)
        out["policy_version"] = [v + 1 if i % 2 == 0 and v + 1 <= step else v
                                 for i, v in enumerate(out["policy_version"])]
        return out


def test_bypass_batch_norm_excludes_the_rows_max_policy_lag_drops(llama_dir, tmp_path):
    """Micro-batch 8 x accumulation 1 and micro-batch 4 x accumulation 2 are the same optimizer step (8 rows, one
    generation): with max_policy_lag drops the batch-norm mean must be over the kept rows in both, so the grad norms
    and the logged (applied) factor agree. Measured on main before the fix: step 3 grad norm 12.03 (8 x 1) vs 19.91
    (4 x 2) while both logged the same factor 0.0392 (not the one 4 x 2 applied)."""
    runs = {}
    for mb, ga in ((8, 1), (4, 2)):
        _, logs = _train(llama_dir, tmp_path / f"{mb}x{ga}", _HalfFresher(sync_interval=3), max_steps=3,
                         rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True, max_policy_lag=1,
                         per_device_train_batch_size=mb, gradient_accumulation_steps=ga, loss_type="grpo")
        runs[(mb, ga)] = logs
    whole, split = runs[(8, 1)], runs[(4, 2)]
    dropped = [log["rollout_corr/policy_lag_dropped_fraction"] for log in whole]
    assert dropped[0] == 0.0 and 0.0 < dropped[2] < 1.0, dropped  # a step with some rows dropped, some kept
    factor = "rollout_corr/rollout_is_batch_norm_factor"
    assert abs(whole[2][factor] - 1.0) > 1e-3  # the normalisation acts on the step with drops
    for a, b in zip(whole, split):
        assert b["rollout_corr/policy_lag_dropped_fraction"] == a["rollout_corr/policy_lag_dropped_fraction"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
        assert b[factor] == pytest.approx(a[factor], rel=1e-5), a["step"]


def _assert_engine_ratio_is_one_on_stale_steps(logs):
    stale = [log for log in logs if log["rollout_corr/policy_lag_mean"] > 0]
    assert stale, "no stale step"
    for log in logs:
        for key in ENGINE_KEYS:
            assert abs(log[key] - 1.0) < 1e-5, (log["step"], key, log[key])
    # the staleness is in the lag ratio
    assert max(abs(log["rollout_corr/lag_ratio_max"] - 1.0) for log in stale) > 1e-3


def test_lag_split_scores_the_version_forward_over_the_engines_support(llama_dir, tmp_path):
    """A float32 top-p 0.8 engine, sync interval 3, support matching "recompute": pi_train@v over the engine's
    support is mu exactly, so the stale steps' engine ratio is 1 to 1e-5 (before: median ~0.80, 1/S absorbed by the
    lag ratio)."""
    _, logs = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3, top_p=0.8), max_steps=4,
                     policy_lag_split=True, rollout_support_matching="recompute", top_p=0.8)
    _assert_engine_ratio_is_one_on_stale_steps(logs)


def test_lag_split_replays_each_rows_own_routes_in_the_version_forward(tmp_path):
    """A tiny Qwen3-MoE engine (float32, its routes returned), sync interval 3, routing_replay="r3", generation
    batches of two forward chunks: the version forward with each row's own routes is the engine's forward, so the
    stale steps' engine ratio is 1 to 1e-5 (issue 22 measured p01 0.83 / max 1.87; here the step-3 mean is 0.975)."""
    moe = make_tiny_model_dir(str(tmp_path / "moe"), "qwen3_moe", seed=0)
    _, logs = _train(moe, tmp_path, StaleRollout(sync_interval=3, routes=True), max_steps=4,
                     policy_lag_split=True, routing_replay="r3", router_aux_loss_coef=0.0,
                     gradient_accumulation_steps=2)  # 8 rows a generation, scored in two chunks of 4
    _assert_engine_ratio_is_one_on_stale_steps(logs)


@pytest.mark.xfail(strict=True, reason="issue 22: the records of a policy_lag_split run do not hold pi_train@v, so "
                   "analyze recomputes engine_ratio_* as pi_old / mu and reports MISMATCH")
def test_analyze_reproduces_the_lag_split_engine_ratio_of_stale_rollouts(llama_dir, tmp_path):
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    _, logs = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3), max_steps=4, policy_lag_split=True,
                     rollout_dump_dir=str(tmp_path / "dump"))
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0, 0.0]
    check, _, _ = analyse_dump(open_dump(tmp_path / "dump"), [])
    assert check.ok and not check.skipped, check.failures[:3]
    assert not set(ENGINE_KEYS) & check.not_recomputed  # engine_ratio_* recomputed, and equal
    assert all(math.isfinite(log[k]) for log in logs for k in ENGINE_KEYS)
