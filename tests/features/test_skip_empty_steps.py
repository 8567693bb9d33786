"""``skip_empty_steps`` (issue 44, minor): an optimizer step in which no token carries gradient leaves the weights
exactly as they were, where TRL's AdamW moves them on a zero gradient (momentum, weight decay).

A stale float32 engine synced every 3 steps with ``max_policy_lag=0``: the rows of steps 1 and 2 (lags 1 and 2) are
all dropped, so those steps train no token. Without the option the weights move at both steps (AdamW's momentum
from step 0); with it they are bit-identical to the weights after step 0, ``rollout_corr/skipped_step_fraction``
logs 1 there and 0 elsewhere, and the steps that train are the same as without the option. Also with gradient
accumulation (the count is summed over the optimizer step's micro-batches).
"""

from __future__ import annotations

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.features import SkipEmptySteps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("_silence_trl_experimental")]


def _train(llama_dir, tmp_path, skip, accumulation):
    from transformers import TrainerCallback

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / f"out_{skip}_{accumulation}"), per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation, num_generations=4, max_completion_length=8, max_steps=4,
        logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3, save_strategy="no", beta=0.0, seed=0,
        disable_tqdm=True, bf16=False, rollout_corr_preset="decoupled_token_is", max_policy_lag=0,
        skip_empty_steps=skip)
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=StaleRollout(sync_interval=3))
    weights = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))

    trainer.add_callback(Snapshot())
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h], weights


@pytest.mark.parametrize("accumulation", [1, 2])
def test_empty_steps_leave_the_weights_alone(llama_dir, tmp_path, accumulation):
    _, plain_logs, plain = _train(llama_dir, tmp_path, False, accumulation)
    trainer, logs, skipped = _train(llama_dir, tmp_path, True, accumulation)
    dropped = [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs]
    assert dropped == [0.0, 1.0, 1.0, 0.0] == [log["rollout_corr/policy_lag_dropped_fraction"] for log in plain_logs]
    # TRL's optimizer on a zero gradient: AdamW's momentum moves the weights at both empty steps
    assert [log["grad_norm"] for log in plain_logs][1:3] == [0.0, 0.0]
    assert (plain[1] - plain[0]).abs().max() > 1e-5 and (plain[2] - plain[1]).abs().max() > 1e-5
    # skipped: exactly the weights of step 0
    assert [log["rollout_corr/skipped_step_fraction"] for log in logs] == [0.0, 1.0, 1.0, 0.0]
    assert trainer.rollout_corr_features.get(SkipEmptySteps).skipped == [1, 2]  # global_step at the skip
    assert torch.equal(skipped[1], skipped[0]) and torch.equal(skipped[2], skipped[0])
    # the step before any skip is the same step; the last one trains (from other weights and optimizer state)
    assert torch.equal(skipped[0], plain[0]) and logs[0]["loss"] == plain_logs[0]["loss"]
    assert (skipped[3] - skipped[2]).abs().max() > 1e-5 and not torch.equal(skipped[3], plain[3])
    assert "rollout_corr/skipped_step_fraction" not in plain_logs[0]


def test_skip_empty_steps_needs_a_correction(tmp_path, make_args):
    with pytest.raises(ValueError, match="skip_empty_steps skips the optimizer .* Configure a rollout correction"):
        make_args(tmp_path, skip_empty_steps=True)
    assert make_args(tmp_path, rollout_corr_preset="decoupled_token_is", skip_empty_steps=True).skip_empty_steps



def test_skip_empty_steps_refuses_fp16(tmp_path, make_args):
    """A skipped step would skip accelerate's GradScaler update after clipping unscaled the gradients (the next
    unscale_ fails): refused at construction."""
    with pytest.raises(ValueError, match="skip_empty_steps with fp16"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", skip_empty_steps=True, fp16=True, bf16=False)
