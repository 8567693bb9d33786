"""pi_old from the first loss forward (``rollout_corr_old_forward="auto"``, ``old_forward``): the same training as
with pi_old's own forward (``"always"``), one forward fewer per generation batch, and the fallbacks named.

Every comparison runs the same 3-step job twice, elision on and off: losses, grad norms and every ``rollout_corr/*``
metric (and TRL's other logged values, timings aside) agree to 1e-6 (relative to the value's size above 1)."""

from __future__ import annotations

import logging
import math

import pytest

from tiny_model import make_tiny_model_dir

DECOUPLED = dict(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_generate_dtype="bfloat16")
TOL = 1e-6


def _logged(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if isinstance(v, (int, float)) and "time" not in k and k != "epoch"}
            for h in trainer.state.log_history if "loss" in h]


def _assert_same_training(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 3
    for step, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y), (step, set(x) ^ set(y))
        assert any(k.startswith("rollout_corr/") for k in x)
        for key in x:
            if math.isnan(x[key]) and math.isnan(y[key]):
                continue
            assert abs(x[key] - y[key]) <= TOL * max(1.0, abs(x[key])), (step, key, x[key], y[key])


def _both(make_trainer, model_dir, tmp_path, **config):
    """The same run with pi_old read from the loss forward and with its own forward: (auto, always) trainers."""
    out = []
    for setting in ("auto", "always"):
        trainer = make_trainer(model_dir, tmp_path / setting, rollout_corr_old_forward=setting, **config)
        trainer.train()
        out.append(trainer)
    return out


@pytest.mark.parametrize("name, config", [
    ("decoupled", DECOUPLED),
    ("diagnostics (no correction)", dict(rollout_generate_dtype="bfloat16")),
    ("decoupled + support matching", dict(DECOUPLED, rollout_support_matching="recompute", top_p=0.9)),
    ("decoupled + max_policy_lag", dict(DECOUPLED, max_policy_lag=0)),
    ("decoupled + beta + dr_grpo", dict(DECOUPLED, beta=0.04, loss_type="dr_grpo")),
])
def test_elided_pi_old_trains_as_its_own_forward(name, config, llama_dir, tmp_path, make_trainer, caplog):
    with caplog.at_level(logging.INFO, logger="trl_rollout_corr.old_forward"):
        auto, always = _both(make_trainer, llama_dir, tmp_path, **config)
    _assert_same_training(_logged(auto), _logged(always))
    assert auto.rollout_corr_old_forward_plan.from_loss and not always.rollout_corr_old_forward_plan.from_loss
    assert auto.rollout_corr_forward_counts["old_log_probs"] == 0
    assert auto.rollout_corr_forward_counts["old_from_loss"] == 3
    assert always.rollout_corr_forward_counts["old_log_probs"] == 3
    assert always.rollout_corr_forward_counts["old_from_loss"] == 0
    lines = [r.getMessage() for r in caplog.records if "pi_old (" in r.getMessage()]
    assert len(lines) == 2 and "read from the first loss forward" in lines[0]
    assert "one extra no-grad forward" in lines[1] and "'always'" in lines[1]


def test_elided_pi_old_with_routing_replay(qwen3_moe_dir, tmp_path, make_trainer):
    auto, always = _both(make_trainer, qwen3_moe_dir, tmp_path, routing_replay="r3", **DECOUPLED)
    a, b = _logged(auto), _logged(always)
    _assert_same_training(a, b)
    assert all("rollout_corr/routing_mismatch_fraction" in h for h in a)  # measured by the elided forward
    assert auto.rollout_corr_forward_counts["old_log_probs"] == 0


def test_elided_pi_old_with_records_writes_the_same_records(llama_dir, tmp_path, make_trainer):
    from trl_rollout_corr.records import open_dump

    runs = []
    for setting in ("auto", "always"):
        trainer = make_trainer(llama_dir, tmp_path / f"rec_{setting}", rollout_corr_old_forward=setting,
                               rollout_dump_dir=str(tmp_path / f"dump_{setting}"), **DECOUPLED)
        trainer.train()
        runs.append(trainer)
    _assert_same_training(_logged(runs[0]), _logged(runs[1]))
    tables = [open_dump(str(tmp_path / f"dump_{s}")).read_table().to_pylist() for s in ("auto", "always")]
    assert len(tables[0]) == len(tables[1]) == 12
    for x, y in zip(*tables):
        for key in x:
            if "time" in key:
                continue
            if key in ("old_log_probs", "log_probs", "rollout_is_weights"):
                assert all(abs(p - q) <= TOL for p, q in zip(x[key], y[key]) if p is not None), key
            else:
                assert x[key] == y[key], key


def test_elided_pi_old_with_num_iterations_replaces_trls_forward(llama_dir, tmp_path, make_trainer):
    """num_iterations=2: TRL's rule runs its own pi_old forward; the elision replaces it by the first iteration's
    loss forward and the second iteration reuses the stored pi_old and correction."""
    auto, always = _both(make_trainer, llama_dir, tmp_path, num_iterations=2, **DECOUPLED)
    _assert_same_training(_logged(auto), _logged(always))
    assert auto.rollout_corr_old_forward_plan.replaces_trl_old_forward
    assert auto.rollout_corr_forward_counts["old_from_loss"] == 2  # generation batches at steps 0 and 2
    assert auto.rollout_corr_forward_counts["old_log_probs"] == 0


@pytest.mark.parametrize("config, reason", [
    (dict(steps_per_generation=2, gradient_accumulation_steps=2, per_device_train_batch_size=2),
     "steps_per_generation=2"),
    (dict(policy_lag_split=True), "policy_lag_split"),
])
def test_fallbacks_keep_the_forward_and_say_why(config, reason, llama_dir, tmp_path, make_trainer, caplog):
    with caplog.at_level(logging.INFO, logger="trl_rollout_corr.old_forward"):
        trainer = make_trainer(llama_dir, tmp_path, **DECOUPLED, **config)
    plan = trainer.rollout_corr_old_forward_plan
    assert not plan.from_loss and plan.reasons[0].startswith(reason)
    lines = [r for r in caplog.records if "pi_old (" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0].getMessage() and lines[0].levelno == logging.WARNING
    trainer.train()
    assert trainer.rollout_corr_forward_counts["old_from_loss"] == 0
    assert trainer.rollout_corr_forward_counts["old_log_probs"] >= 1


def test_dropout_model_keeps_the_forward(tmp_path, make_trainer):
    from transformers import AutoConfig

    model_dir = make_tiny_model_dir(str(tmp_path / "dropout_llama"), "llama", seed=0)
    config = AutoConfig.from_pretrained(model_dir)
    config.attention_dropout = 0.1
    config.save_pretrained(model_dir)
    trainer = make_trainer(model_dir, tmp_path, **DECOUPLED)
    assert not trainer.rollout_corr_old_forward_plan.from_loss
    assert "config.attention_dropout=0.1" in trainer.rollout_corr_old_forward_plan.reasons[0]


def test_bypass_has_no_plan_and_no_pi_old_forward(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="bypass_ppo_clip", max_steps=1)
    assert trainer.rollout_corr_old_forward_plan is None
    trainer.train()
    assert trainer.rollout_corr_forward_counts["old_log_probs"] == trainer.rollout_corr_forward_counts[
        "old_from_loss"] == 0


def test_unknown_setting_is_refused(make_args, tmp_path):
    with pytest.raises(ValueError, match="rollout_corr_old_forward must be one of"):
        make_args(tmp_path, rollout_corr_old_forward="never")


def test_always_in_bypass_mode_is_refused(make_args, tmp_path):
    """Bypass mode has no pi_old forward to keep (pi_old := mu): 'always' would be silently ignored there."""
    with pytest.raises(ValueError, match=r"rollout_corr_old_forward='always' .* bypass mode has none .* unset it .* "
                                         r"or use decoupled mode \(bypass_mode=False\)"):
        make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip", rollout_corr_old_forward="always")
    assert make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip").rollout_corr_old_forward == "auto"
    assert make_args(tmp_path, rollout_corr_old_forward="always").rollout_corr_old_forward == "always"  # diagnostics
    assert make_args(tmp_path, rollout_corr_preset="decoupled_token_is",
                     rollout_corr_old_forward="always").rollout_corr_old_forward == "always"
