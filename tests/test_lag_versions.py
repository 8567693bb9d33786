"""Versions under the lag split (issue 44, items 1 and 2), through the trainer on a tiny float32 model.

* Item 2: an asynchronous engine that publishes the trainer's weights after EVERY optimizer step (as
  ``VLLMCPURollout(async_depth=d)`` does) while the trainer generates only every other step (``num_iterations=2``,
  or ``steps_per_generation`` > accumulation) hands the split rows of a version at which no generation ran; the
  split's version store must hold it (it crashed with "held: [0, 2]" before).
* Item 1: a rollout that spans a weight update (``policy_version`` per token): each token is scored at its own
  version, so with mu equal to the trainer's log-prob at each token's own version the engine factor is 1 and
  engine-factor RS with a token_k1 band [0.999, 1.001] masks nothing (it masked about half of each such row when
  every token was scored at the row's oldest version).
"""

from __future__ import annotations

import pytest

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _silence_trl_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL


class PublishingRollout(StaleRollout):
    """``StaleRollout(async_depth=d)`` that publishes the trainer's weights after every optimizer step (a
    ``TrainerCallback``, ``on_step_end``, added at the first call), like ``VLLMCPURollout``'s async queue: step s's
    batch is generated with the weights of step ``s - d`` exactly, also between the trainer's generations."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.callback = None

    def __call__(self, prompts, trainer):
        if self.callback is None:
            from transformers import TrainerCallback

            rollout = self

            class Publish(TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):
                    model = trainer.accelerator.unwrap_model(trainer.model)
                    rollout.published.setdefault(int(state.global_step), {
                        k: v.detach().clone() for k, v in model.state_dict().items()})

            self.callback = Publish()
            trainer.add_callback(self.callback)
        return super().__call__(prompts, trainer)


def _train(llama_dir, tmp_path, rollout, **overrides):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "learning_rate": 1e-3, "save_strategy": "no", "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False,
        "rollout_corr_preset": "decoupled_token_is", "policy_lag_split": True, **overrides})
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=rollout)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("shape", ["num_iterations_2", "steps_per_generation_2"])
def test_lag_split_holds_every_version_an_async_engine_publishes(llama_dir, tmp_path, shape):
    """Async depth 1, published every optimizer step, a generation every other step: the batch of step 2 comes from
    version 1, a step at which the trainer did not generate. The split scores it (no ValueError), and float32 on
    both sides makes its engine factor 1 (to 1e-5) while the lag ratio carries the staleness."""
    overrides = dict(num_iterations=2) if shape == "num_iterations_2" else dict(
        steps_per_generation=2, per_device_train_batch_size=2)
    rollout = PublishingRollout(async_depth=1)
    trainer, logs = _train(llama_dir, tmp_path, rollout, **overrides)
    assert rollout.calls == [(0, 0), (2, 1)]  # (trainer step, engine version) per generation
    assert trainer.rollout_corr_forward_counts["version_log_probs"] >= 1
    # lags: step 0 -> 0, step 1 -> 1 (the batch of step 0 again), step 2 -> 1 (version 1), step 3 -> 2
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0, 1, 1, 2]
    for log in logs:
        for q in ("p01", "max"):
            assert abs(log[f"rollout_corr/engine_ratio_{q}"] - 1.0) < 1e-5, (log["step"], q)
    assert abs(logs[2]["rollout_corr/lag_ratio_max"] - 1.0) > 1e-3  # version 1 is one update behind step 2
