"""Trainer semantics issue 9 fixed or wrote down: batch normalisation over the optimizer step in bypass mode, the
dual clip of bypass PPO-clip, IcePop's loss denominator, token-level rejection of a reward-bearing last token, and
rows left alone in their GRPO group by rejection sampling."""

from __future__ import annotations

import math
import re

import pytest
import torch

from trl_rollout_corr import compute_rollout_correction

TRL_ADVANTAGE_OF_A_PAIR = 0.5 / (math.sqrt(0.5) + 1e-4)  # rewards (1, 0): (r - mean) / (unbiased std + 1e-4)


# ---------------------------------------------------------------------------------------------- batch normalisation
def test_bypass_sequence_is_with_batch_norm_trains_the_same_for_any_micro_batching(llama_dir, tmp_path, make_trainer,
                                                                                     step_logs):
    """Micro-batch 1 x accumulation 4 and micro-batch 4 x accumulation 1 are the same optimizer step, so batch
    normalisation (spec section 3: over the step's global batch) must give the same update.

    Before the fix bypass normalised per micro-batch: with one row per micro-batch every applied weight was exactly
    1 (the correction cancelled) and the step-1 gradient norms differed (measured 27.036 vs 29.102)."""
    runs, applied, windows = {}, {}, {}
    for mb, ga in ((1, 4), (4, 1)):
        trainer = make_trainer(llama_dir, tmp_path / f"{mb}x{ga}", rollout_corr_preset="bypass_pg_is",
                               rollout_is_batch_normalize=True, per_device_train_batch_size=mb,
                               gradient_accumulation_steps=ga, top_p=0.8, loss_type="grpo", max_steps=2)
        calls = applied[(mb, ga)] = []
        correction_fn = trainer.rollout_corr_mode.correction_fn

        def spy(log_probs, rollout_log_probs, mask, all_reduce=None, _fn=correction_fn, _calls=calls, _mb=mb):
            out = _fn(log_probs, rollout_log_probs, mask, all_reduce=all_reduce)
            if log_probs.size(0) == _mb:  # a loss micro-batch (not the step's no-grad pre-pass)
                _calls.append(out.weights[:, 0].tolist())  # sequence IS: one weight per row, at every valid token
            return out

        trainer.rollout_corr_mode.correction_fn = spy
        trainer.train()
        runs[(mb, ga)] = step_logs(trainer)
        windows[(mb, ga)] = trainer.rollout_corr_forward_counts.get("batch_norm_window")
    for small, whole in zip(runs[(1, 4)], runs[(4, 1)]):
        assert small["grad_norm"] == pytest.approx(whole["grad_norm"], abs=1e-4)
        assert small["loss"] == pytest.approx(whole["loss"], abs=1e-5)
        assert small["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(
            whole["rollout_corr/rollout_is_batch_norm_factor"], rel=1e-6)
    assert runs[(4, 1)][0]["rollout_corr/rollout_is_batch_norm_factor"] < 0.9  # the normalisation does act here
    # the applied weights of each step average to 1 over the step's 4 rows, and are not all 1
    for step in range(2):
        weights = [w for call in applied[(1, 4)][4 * step: 4 * step + 4] for w in call]
        assert sum(weights) / 4 == pytest.approx(1.0, abs=1e-5) and max(abs(w - 1.0) for w in weights) > 1e-2
        assert sorted(weights) == pytest.approx(sorted(applied[(4, 1)][step]), abs=1e-5)
    assert windows == {(1, 4): 2, (4, 1): 0}  # one no-grad scoring of the step's rows per step, only when needed


def test_bypass_batch_norm_over_a_step_of_a_buffered_generation(llama_dir, tmp_path, make_trainer, step_logs):
    """steps_per_generation 8 x accumulation 4 (micro-batch 2): each generation feeds two optimizer steps, the second
    one from TRL's buffer at lag 1, where W is not 1. The no-grad scoring at a step's first micro-batch must take
    that step's 4 micro-batches of the buffer (micro-steps 4..7 at the second), so the weights each step applies
    average to exactly 1 over its 8 rows, and the logged factor is the one applied (it is logged from the loss
    calls' statistics, so a factor scored over the wrong rows would not show in the logs or in analyze)."""
    trainer = make_trainer(llama_dir, tmp_path / "o", rollout_corr_preset="bypass_pg_is", rollout_is="sequence",
                           rollout_is_batch_normalize=True, steps_per_generation=8, gradient_accumulation_steps=4,
                           per_device_train_batch_size=2, num_generations=4, max_steps=4, learning_rate=1e-2,
                           loss_type="grpo")
    calls, totals = [], []
    correction_fn = trainer.rollout_corr_mode.correction_fn

    def spy(log_probs, rollout_log_probs, mask, all_reduce=None):
        out = correction_fn(log_probs, rollout_log_probs, mask, all_reduce=all_reduce)
        if log_probs.size(0) == 2:  # a loss micro-batch
            calls.append(out.weights[:, 0].tolist())  # sequence IS: one weight per row
            totals.append(all_reduce(None))  # the step's (sum, count) the window scored
        return out

    trainer.rollout_corr_mode.correction_fn = spy
    trainer.train()
    logs = step_logs(trainer)
    assert trainer.rollout_corr_forward_counts["batch_norm_window"] == 4
    for step, log in enumerate(logs):
        weights = [w for call in calls[4 * step: 4 * step + 4] for w in call]
        assert len(weights) == 8 and sum(weights) / 8 == pytest.approx(1.0, abs=1e-5), step
        total = totals[4 * step]
        assert float(total[0] / total[1]) == pytest.approx(log["rollout_corr/rollout_is_batch_norm_factor"],
                                                            rel=1e-6), step
    factors = [log["rollout_corr/rollout_is_batch_norm_factor"] for log in logs]
    assert factors[0] == pytest.approx(1.0, abs=1e-5) and factors[2] == pytest.approx(1.0, abs=1e-5)  # lag 0
    assert max(abs(factors[1] - 1.0), abs(factors[3] - 1.0)) > 1e-2  # lag 1: the normalisation acts


def test_batch_norm_combinations_that_cannot_be_exact_are_refused(tmp_path, make_args):
    # decoupled: weights are normalised once per generation batch, which here spans two optimizer steps
    with pytest.raises(ValueError, match="rollout_is_batch_normalize=True in decoupled mode .* steps_per_generation"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", rollout_is_batch_normalize=True,
                  steps_per_generation=2)
    # bypass: a step whose second half is generated only after its first micro-batch
    with pytest.raises(ValueError, match="bypass_mode=True normalises over the optimizer step's rows"):
        make_args(tmp_path, rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True, num_generations=2,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=1)
    # exact combinations are accepted (TRL's default steps_per_generation = gradient_accumulation_steps)
    make_args(tmp_path, rollout_corr_preset="decoupled_token_is", rollout_is_batch_normalize=True,
              per_device_train_batch_size=2, gradient_accumulation_steps=2)
    make_args(tmp_path, rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True,
              per_device_train_batch_size=1, gradient_accumulation_steps=4, steps_per_generation=8)


# ---------------------------------------------------------------------------------------------- dual clip
def test_bypass_ppo_clip_dual_clip_keeps_the_logged_loss_meaningful(llama_dir, tmp_path, make_trainer, loss_inputs):
    """A token at the ratio's safety bound (log pi_theta / mu = 20) with A < 0 contributed |A| e^20 = 4.9e8 to the
    logged loss (with zero gradient) before the fix; the dual clip (verl's clip_ratio_c = 3 by default, TRL's
    ``delta`` when set) caps it at |A| c."""
    huge = math.exp(20.0)
    for delta, cap in ((None, 3.0), (4.0, 4.0)):
        trainer = make_trainer(llama_dir, tmp_path / str(delta), rollout_corr_preset="bypass_ppo_clip",
                               loss_type="grpo", delta=delta)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs, logp, log_direct = loss_inputs(trainer, [[huge, 1.0, 1.0], [1.0, 1.0, 1.0]], [-1.0, 0.5])
        inputs["rollout_log_probs"] = logp - log_direct
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        loss = trainer._compute_loss(trainer.model, inputs)
        # row 0 (A = -1): min(max(e^20, clip), c) = c, then 1, 1 -> (c + 2) / 3; row 1 (A = 0.5): -0.5, -0.5 -> -0.5
        assert loss.item() == pytest.approx(((cap + 2) / 3 - 0.5) / 2, abs=1e-5)
        grads = torch.autograd.grad(loss, params)
        # the capped token has no gradient: the reference loss holds it constant
        lp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), 3)
        ratio = torch.exp(lp.float() - inputs["rollout_log_probs"])
        reference = ((cap + ratio[0, 1] + ratio[0, 2]) / 3 + (-0.5 * ratio[1, 0] - 0.5 * ratio[1, 1]) / 2) / 2
        for a, b in zip(grads, torch.autograd.grad(reference, params)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_delta_in_bypass_is_checked_when_the_config_is_built(tmp_path, make_args):
    with pytest.raises(ValueError, match="delta > 1 \\+ epsilon_high"):
        make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip", delta=1.1)
    with pytest.raises(ValueError, match="has no ratio in its loss"):
        make_args(tmp_path, rollout_corr_preset="bypass_pg_is", delta=2.0)
    assert make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip", delta=2.0).delta == 2.0


def test_epsilon_with_bypass_reinforce_is_refused_it_has_no_clip(tmp_path, make_args):
    """REINFORCE (-A w log pi_theta) has no ratio to clip: a changed epsilon / epsilon_high would be ignored."""
    for clip in (dict(epsilon=0.1), dict(epsilon_high=0.28), dict(epsilon=0.1, epsilon_high=0.28)):
        named = ", ".join(f"{k}={v!r}" for k, v in clip.items())
        with pytest.raises(ValueError, match=re.escape(named) + r" set the PPO clip range, but "
                           r"bypass_loss_type='reinforce' has no ratio in its loss, so it would be ignored; leave "
                           r"epsilon / epsilon_high at TRL's defaults \(0\.2 / None\) or use "
                           r"bypass_loss_type='ppo_clip'"):
            make_args(tmp_path, rollout_corr_preset="bypass_pg_is", **clip)
        # the valid neighbours: PPO-clip uses them (bypass and decoupled), REINFORCE at TRL's defaults
        assert make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip", **clip).epsilon == clip.get("epsilon", 0.2)
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", **clip)
    assert make_args(tmp_path, rollout_corr_preset="bypass_pg_is", epsilon=0.2).epsilon_high is None


# ---------------------------------------------------------------------------------------------- IcePop vs RS
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_icepop_zeroed_tokens_stay_in_the_loss_denominator_rs_rejected_ones_leave_it(loss_type, llama_dir, tmp_path,
                                                                                     make_trainer, loss_inputs):
    """Decided (docs/reference/trainer.md, "Semantics"): IcePop zeroes a weight, RS removes a token. An IcePop token
    outside
    [L, U] adds 0 to the loss but still counts in its normaliser (as in the IcePop paper, verl, slime's icepop and
    prime-rl's masked losses); an RS-rejected token leaves the loss mask and the normaliser."""
    engine = [[3.0, 1.5, 0.8], [1.2, 0.25, 1.0]]  # pi_old / mu; pi_theta = pi_old (update ratio 1)
    losses = {}
    for name, fields in (("icepop", dict(rollout_is="token", rollout_is_threshold="0.5_2.0")),
                         ("rs", dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))):
        trainer = make_trainer(llama_dir, tmp_path / f"{name}{loss_type}", loss_type=loss_type, **fields)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs, logp, log_engine = loss_inputs(trainer, engine, [1.0, -0.5])
        old, mask = logp, inputs["completion_mask"]
        out = compute_rollout_correction(old, old - log_engine, mask, trainer.rollout_correction)
        inputs.update(old_per_token_logps=old, rollout_log_probs=old - log_engine, rollout_rs_mask=out.response_mask,
                      rollout_is_weights=out.weights, num_items_in_batch=out.response_mask.sum())
        losses[name] = trainer._compute_loss(trainer.model, inputs).item()
    if loss_type == "grpo":
        # IcePop: row 0 (A=1) W = [0, 1.5, 0.8] over 3 tokens; row 1 (A=-0.5) W = [1.2, 0] over 2
        assert losses["icepop"] == pytest.approx(((-1.5 - 0.8) / 3 + 0.6 / 2) / 2, abs=1e-5)
        # RS: row 0 keeps tokens 1, 2 (weight 1) over 2; row 1 keeps token 0 over 1
        assert losses["rs"] == pytest.approx((-2.0 / 2 + 0.5 / 1) / 2, abs=1e-5)
    else:  # dapo: sum / loss tokens of the batch: 5 for IcePop (mask unchanged), 3 after RS
        assert losses["icepop"] == pytest.approx((-1.5 - 0.8 + 0.6) / 5, abs=1e-5)
        assert losses["rs"] == pytest.approx((-1.0 - 1.0 + 0.5) / 3, abs=1e-5)


# ---------------------------------------------------------------------------------------------- rejected rows
def _scored_batch(trainer):
    """Two GRPO groups of 2 (rewards 1, 0 each), 3 completion tokens per row, as TRL scored them."""
    from trl_rollout_corr import trl_compat

    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    advantages = trl_compat.group_advantages(rewards, torch.zeros(4, dtype=torch.bool), reward_weights=torch.ones(1),
                                             num_generations=2, multi_objective_aggregation="sum_then_normalize",
                                             scale_rewards="group")
    old = torch.full((4, 3), -1.0)
    engine = torch.tensor([[3.0, 3.0, 3.0],   # group 0: row 0 rejected entirely
                           [1.0, 1.0, 1.0],   # its group-mate, alone in the group afterwards
                           [1.0, 1.0, 3.0],   # group 1: row 2 loses its last (EOS, reward-bearing) token only
                           [1.0, 1.0, 1.0]]).log()
    output = dict(completion_mask=torch.ones(4, 3, dtype=torch.long), old_per_token_logps=old,
                  rollout_log_probs=old - engine, advantages=advantages.clone(),
                  prompt_ids=torch.ones(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.long),
                  completion_ids=torch.ones(4, 3, dtype=torch.long))
    trainer._logs["advantages"].extend(advantages.tolist())
    return output, rewards, advantages


@pytest.mark.parametrize("keep_in_baseline", [False, True])
def test_rejected_rows_their_group_mates_and_a_rejected_last_token(keep_in_baseline, llama_dir, tmp_path,
                                                                  make_trainer):
    """Decided (docs/reference/trainer.md, "Semantics"):

    * a row whose every group-mate is RS-rejected is alone in its group's baseline, so its advantage is 0 (TRL's
      rule for a group with one scorable completion; counted in ``rs_lone_survivor_fraction``); verl keeps rejected
      rows in the baseline and gives it 0.707 in a group of 2 (``rs_keep_rejected_in_baseline=True``);
    * a row that loses only some tokens, its reward-bearing last token included, keeps its full advantage on the
      remaining ones and stays in its group's baseline (token-level RS is per token, as in verl).
    """
    trainer = make_trainer(llama_dir, tmp_path, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0",
                           num_generations=2, rs_keep_rejected_in_baseline=keep_in_baseline)
    trainer.model.train()
    output, rewards, before = _scored_batch(trainer)
    assert before.tolist() == pytest.approx([TRL_ADVANTAGE_OF_A_PAIR, -TRL_ADVANTAGE_OF_A_PAIR] * 2)
    trainer.rollout_corr_mode.apply_correction(trainer, output, rewards)
    assert output["rollout_rs_mask"].tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
    lone = -TRL_ADVANTAGE_OF_A_PAIR if keep_in_baseline else 0.0
    assert output["advantages"].tolist() == pytest.approx([0.0, lone, TRL_ADVANTAGE_OF_A_PAIR,
                                                           -TRL_ADVANTAGE_OF_A_PAIR], abs=1e-6)
    assert list(trainer._logs["advantages"])[-4:] == pytest.approx(output["advantages"].tolist(), abs=1e-6)
    metrics = trainer.rollout_corr_metrics.flush("train")
    assert metrics.get("rollout_corr/rs_lone_survivor_fraction") == (None if keep_in_baseline else 0.25)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)  # rows with a masked token
    assert int(output["num_items_in_batch"]) == 8


@pytest.mark.parametrize("keep_in_baseline", [False, True])
def test_a_row_of_invalid_tokens_leaves_the_baseline_without_rs_unless_kept(keep_in_baseline, llama_dir, tmp_path,
                                                                           make_trainer):
    """Decoupled IS only (no RS): a row whose every mu is NaN has no valid token left, so it is emptied like a fully
    RS-rejected row, and ``rs_keep_rejected_in_baseline`` decides its group's baseline here too (why the config
    accepts the flag without RS in decoupled mode): out, its group-mate is alone (advantage 0); kept, the mate keeps
    TRL's -0.707."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_is="token", rollout_is_threshold=2.0, num_generations=2,
                           rs_keep_rejected_in_baseline=keep_in_baseline)
    trainer.model.train()
    output, rewards, _ = _scored_batch(trainer)
    output["rollout_log_probs"] = output["old_per_token_logps"].clone()  # ratio 1 everywhere ...
    output["rollout_log_probs"][0] = float("nan")  # ... but row 0's mu is NaN: every token invalid
    trainer.rollout_corr_mode.apply_correction(trainer, output, rewards)
    assert output["rollout_rs_mask"].tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    mate = -TRL_ADVANTAGE_OF_A_PAIR if keep_in_baseline else 0.0
    assert output["advantages"].tolist() == pytest.approx([0.0, mate, TRL_ADVANTAGE_OF_A_PAIR,
                                                           -TRL_ADVANTAGE_OF_A_PAIR], abs=1e-6)
    metrics = trainer.rollout_corr_metrics.flush("train")
    assert metrics["rollout_corr/invalid_token_fraction"] == pytest.approx(0.25)
    assert "rollout_corr/rs_lone_survivor_fraction" not in metrics  # RS off: not counted as an RS survivor
