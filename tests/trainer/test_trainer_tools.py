"""Tool calling and ``environment_factory`` through the real ``transformers.generate`` with a correction on.

TRL's own tool/environment tests replace ``generate`` with a fake, so nothing else runs the subclass on these
paths: there TRL calls ``_generate_single_turn`` once per turn, concatenates the turns with the tool's answer
between them (``tool_mask`` 0, behaviour log-prob filler 0.0) and trains on the model's tokens only. The tiny model
of ``tool_model`` really calls ``multiply_tool`` in about half of its rollouts.
"""

from __future__ import annotations

import pytest
import torch

from tool_model import MultiplyEnvironment, make_tool_tokenizer, multiply_tool, tool_dataset
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

PRESETS = ("decoupled_k3_rs_token_tis", "bypass_pg_is")


def used_tool(completions, **kwargs):
    return [float(len(c) > 1) + 0.1 * len(c[-1]["content"]) for c in completions]


class Spy(RolloutCorrGRPOTrainer):
    """Keeps every scored generation batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.batches.append({k: v for k, v in out.items() if torch.is_tensor(v)})
        return out


def _train(tool_dir, tmp_path, make_args, preset, how, **overrides):
    extra = dict(tools=[multiply_tool], reward_funcs=used_tool) if how == "tools" else dict(
        environment_factory=MultiplyEnvironment)
    args = make_args(tmp_path, rollout_corr_preset=preset, max_completion_length=48, max_steps=3, **overrides)
    trainer = Spy(model=tool_dir, args=args, train_dataset=tool_dataset(8), processing_class=make_tool_tokenizer(),
                  **extra)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


pytestmark = pytest.mark.usefixtures("_silence_trl_experimental")  # tools, environments


@pytest.mark.parametrize("how", ["tools", "environment"])
@pytest.mark.parametrize("preset", PRESETS)
def test_multi_turn_rollouts_are_corrected_on_the_model_tokens_only(preset, how, tool_dir, tmp_path, make_args):
    trainer, logs = _train(tool_dir, tmp_path, make_args, preset, how)
    assert sum(h["tools/call_frequency"] for h in logs) > 0  # tools were really called
    for h in logs:
        # identical numerics (float32 sampler and trainer): mu is aligned with pi token for token, across turns
        assert abs(h["rollout_corr/kl"]) < 1e-6 and h["rollout_corr/k3_kl"] < 1e-9
        # the tool's answer (tool_mask 0) is excluded: TRL's length counts model tokens only
        assert h["rollout_corr/num_valid_tokens"] == pytest.approx(h["completions/mean_length"] * 4)
        assert h["rollout_corr/invalid_token_fraction"] == 0.0
    multi_turn = 0
    for batch in trainer.batches:
        tool_tokens = (batch["completion_mask"] == 1) & (batch["tool_mask"] == 0)
        multi_turn += int(tool_tokens.any(dim=1).sum())
        assert torch.all(batch["rollout_log_probs"][tool_tokens] == 0.0)  # TRL's filler, never trained on
        if "rollout_rs_mask" in batch:  # decoupled: the loss mask keeps the tool's tokens out
            assert torch.all(batch["rollout_rs_mask"][tool_tokens] == 0)
            assert int(batch["num_items_in_batch"]) == int(batch["rollout_rs_mask"].sum())
    assert multi_turn > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_a_bf16_sampler_mismatch_is_measured_on_multi_turn_rollouts(preset, tool_dir, tmp_path, make_args):
    trainer, logs = _train(tool_dir, tmp_path, make_args, preset, "tools", rollout_generate_dtype="bfloat16")
    assert sum(h["tools/call_frequency"] for h in logs) > 0
    assert max(h["rollout_corr/k3_kl"] for h in logs) > 1e-7  # bf16 sampler vs float32 trainer, on model tokens
    assert all(h["rollout_corr/invalid_token_fraction"] == 0.0 for h in logs)
