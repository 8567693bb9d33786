"""old_forward.py: the rule that says when pi_old is the first loss forward (each condition, by hand)."""

from __future__ import annotations

import pytest
import torch

from trl_rollout_corr.old_forward import dropout_settings, plan_old_forward

BASE = dict(setting="auto", mode="decoupled", steps_per_generation=1, num_iterations=1, trl_computes_old=False)


def test_auto_elides_when_every_condition_holds():
    plan = plan_old_forward(**BASE)
    assert plan.from_loss and plan.reasons == () and not plan.replaces_trl_old_forward
    assert plan.describe().startswith("pi_old (decoupled): read from the first loss forward")


@pytest.mark.parametrize("change, reason", [
    (dict(setting="always"), "rollout_corr_old_forward='always'"),
    (dict(steps_per_generation=4), "steps_per_generation=4: the generation batch is trained in 4 micro-batches"),
    (dict(policy_lag_split=True), "policy_lag_split"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(mode="diagnostics", trl_computes_old=True), "TRL computes pi_old itself"),
])
def test_each_condition_keeps_the_forward_and_names_itself(change, reason):
    plan = plan_old_forward(**{**BASE, **change})
    assert not plan.from_loss and not plan.replaces_trl_old_forward
    assert len(plan.reasons) == 1 and plan.reasons[0].startswith(reason)
    line = plan.describe()
    assert "one extra no-grad forward per generation batch" in line and reason in line and "\n" not in line


def test_several_reasons_share_one_line():
    plan = plan_old_forward(**{**BASE, "setting": "always", "steps_per_generation": 2, "policy_lag_split": True})
    assert len(plan.reasons) == 3 and plan.describe().count("; ") == 2


def test_num_iterations_keeps_the_elision_and_replaces_trls_forward_in_decoupled_only():
    plan = plan_old_forward(**{**BASE, "num_iterations": 2, "trl_computes_old": True})
    assert plan.from_loss and plan.replaces_trl_old_forward
    # no correction: TRL's own pi_old is TRL's (never replaced); the diagnostics read it, nothing to elide
    diag = plan_old_forward(**{**BASE, "mode": "diagnostics", "num_iterations": 2, "trl_computes_old": True})
    assert not diag.from_loss and not diag.replaces_trl_old_forward
    assert plan_old_forward(**{**BASE, "mode": "diagnostics"}).from_loss


def test_dropout_is_found_in_modules_and_in_the_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2)
    assert dropout_settings(LlamaForCausalLM(LlamaConfig(**common))) == []
    with_attention = LlamaForCausalLM(LlamaConfig(attention_dropout=0.1, **common))
    assert dropout_settings(with_attention) == ["config.attention_dropout=0.1"]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.25), torch.nn.Dropout(0.0))
    assert dropout_settings(model) == ["1.p=0.25"]
    plan = plan_old_forward(**BASE, model=with_attention)
    assert not plan.from_loss and "config.attention_dropout=0.1" in plan.reasons[0]


def test_bad_setting_and_mode_are_refused_naming_the_values():
    with pytest.raises(ValueError, match=r"rollout_corr_old_forward must be one of \('auto', 'always'\)"):
        plan_old_forward(**{**BASE, "setting": "never"})
    with pytest.raises(ValueError, match="bypass has no pi_old forward"):
        plan_old_forward(**{**BASE, "mode": "bypass"})
