"""Every TRL 1.16 GRPO feature (``trl_features.FEATURES``): without a correction the subclass is plain TRL (same
logged losses, gradient norms and TRL metrics, step by step, on the same seed), and with each correction preset the
feature either trains or is refused when the config is built, with an error naming it.

The training runs are short (2 steps without a correction, 1 with) on the tiny models, and marked ``slow``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from tiny_model import prompt_dataset, reward_len
from tool_model import MultiplyEnvironment, make_tool_tokenizer, multiply_tool, tool_dataset
from trl_features import FEATURES, NOT_APPLICABLE, PRESETS, UNTESTED, WORKS
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

TRAINED = [f for f in FEATURES if f.train]
CONFIG_ONLY = [f for f in FEATURES if not f.train and f.config]
# keys whose value is a wall-clock time
TIMING = re.compile(r"time|per_second")


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


async def async_reward(completions, **kwargs):
    return [float(c.count("b")) for c in completions]


def used_tool(completions, **kwargs):
    """1 for a rollout that called a tool, plus a little for the length of its last message."""
    return [float(len(c) > 1) + 0.1 * len(c[-1]["content"]) for c in completions]


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def _rollout_func(prompts, trainer):
    """A rollout_func on the policy's own generate, returning per-token log-probs and an env_mask."""
    from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs

    tok = trainer.processing_class
    prompt_ids = [tok(text=p)["input_ids"] for p in prompts]
    model = trainer.accelerator.unwrap_model(trainer.model)
    width = max(len(ids) for ids in prompt_ids)
    batch = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids])
    attention = (batch != tok.pad_token_id).long()
    was_training = model.training
    model.eval()
    with torch.no_grad(), capture_generate_log_probs(model) as capture:
        seqs = model.generate(input_ids=batch, attention_mask=attention, do_sample=True, max_new_tokens=8,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.train(was_training)
    completions = []
    for row in seqs[:, width:].tolist():
        completions.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    env_mask = [[1] * (len(c) - 1) + [0] for c in completions]  # the last token is "the environment's"
    return {"prompt_ids": prompt_ids, "completion_ids": completions,
            "logprobs": capture.completion_log_probs(completions), "env_mask": env_mask}


def trainer_setup(name: str, request) -> tuple[str, dict, dict]:
    """(model, GRPOTrainer keyword arguments, extra config) of a feature's trainer recipe."""
    llama = request.getfixturevalue("llama_dir")
    base = dict(reward_funcs=reward_len, train_dataset=prompt_dataset(8))
    if name in ("", "two_rewards", "async_reward", "iterable", "eval", "optimizers"):
        kwargs = dict(base)
        if name == "two_rewards":
            kwargs["reward_funcs"] = [reward_len, reward_digits]
        elif name == "async_reward":
            kwargs["reward_funcs"] = [reward_len, async_reward]
        elif name == "iterable":
            kwargs["train_dataset"] = prompt_dataset(8).to_iterable_dataset()
        elif name == "eval":
            kwargs["eval_dataset"] = prompt_dataset(4)
        elif name == "optimizers":
            from transformers import AutoModelForCausalLM, TrainerCallback

            class CountSteps(TrainerCallback):
                steps = 0

                def on_step_end(self, args, state, control, **kwargs):
                    CountSteps.steps += 1

            model = AutoModelForCausalLM.from_pretrained(llama)
            kwargs.update(callbacks=[CountSteps()], optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None))
            return model, kwargs, {}
        return llama, kwargs, {}
    if name == "reward_model":
        return llama, dict(base, reward_funcs=request.getfixturevalue("reward_model_dir")), {}
    if name == "moe":
        return request.getfixturevalue("moe_dir"), base, {}
    if name == "rollout_func":
        return llama, dict(base, rollout_func=_rollout_func), {}
    tool = request.getfixturevalue("tool_dir")
    conversational = dict(train_dataset=tool_dataset(8), processing_class=make_tool_tokenizer())
    if name == "chat":
        return tool, dict(conversational, reward_funcs=used_tool), {}
    if name == "tools":
        return tool, dict(conversational, reward_funcs=used_tool, tools=[multiply_tool, async_multiply_tool]), dict(
            max_completion_length=48)
    if name == "environment":
        return tool, dict(conversational, environment_factory=MultiplyEnvironment), dict(max_completion_length=48)
    raise KeyError(name)


def _train(trainer_cls, config_cls, request, tmp_path, make_args, feature, **overrides):
    model, kwargs, extra = trainer_setup(feature.trainer, request)
    args = make_args(tmp_path, config_cls=config_cls, **{**feature.config, **extra, **overrides})
    trainer = trainer_cls(model=model, args=args, **kwargs)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h], trainer


pytestmark = pytest.mark.usefixtures("_silence_trl_experimental")  # tools, environments


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:bf16=True")
@pytest.mark.parametrize("feature", TRAINED, ids=[f.name for f in TRAINED])
def test_feature_without_correction_trains_as_plain_trl(feature, request, tmp_path, make_args):
    trl_logs, _ = _train(GRPOTrainer, GRPOConfig, request, tmp_path / "trl", make_args, feature, max_steps=2)
    ours, trainer = _train(RolloutCorrGRPOTrainer, None, request, tmp_path / "ours", make_args, feature, max_steps=2)
    assert not trainer.rollout_correction.enabled
    assert len(ours) == len(trl_logs) >= 2
    for theirs, mine in zip(trl_logs, ours):
        keys = [k for k in theirs if not TIMING.search(k)]
        assert keys and set(keys) <= set(mine)
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9, nan_ok=True), key


@pytest.mark.parametrize("feature", CONFIG_ONLY, ids=[f.name for f in CONFIG_ONLY])
@pytest.mark.filterwarnings("ignore:bf16=True")
def test_feature_config_without_correction_is_trls(feature, tmp_path, make_args):
    """Features not trained here (GPU, Hub, not installed): the config is TRL's, field for field."""
    if any(k.startswith(("rollout_", "bypass_")) for k in feature.config):
        pytest.skip("a row about one of our own fields")
    theirs = make_args(tmp_path, config_cls=GRPOConfig, **feature.config).to_dict()
    ours = make_args(tmp_path, **feature.config).to_dict()
    assert {k: ours[k] for k in theirs} == theirs


CASES = [(f, column) for f in FEATURES if f.config or f.trainer for column in PRESETS
         if f.expected(column) != NOT_APPLICABLE]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:bf16=True")
@pytest.mark.parametrize("feature, column", CASES, ids=[f"{f.name}-{c}" for f, c in CASES])
def test_feature_with_a_correction_trains_or_is_refused_at_config_time(feature, column, request, tmp_path,
                                                                         make_args):
    overrides = {**PRESETS[column], **feature.config}
    expected = feature.expected(column)
    if expected not in (WORKS, UNTESTED):
        with pytest.raises(ValueError, match=re.escape(expected)):
            make_args(tmp_path, **overrides)
        return
    args = make_args(tmp_path, **overrides)
    assert args.rollout_correction().enabled
    if not feature.train:
        return
    logs, trainer = _train(RolloutCorrGRPOTrainer, None, request, tmp_path, make_args, feature, **PRESETS[column],
                           max_steps=1)
    train_logs = [h for h in logs if "loss" in h]
    assert train_logs and all(math.isfinite(h["loss"]) for h in train_logs)
    assert all("rollout_corr/num_valid_tokens" in h for h in train_logs)
    if column != "decoupled":
        assert trainer.rollout_corr_forward_counts["old_log_probs"] == 0  # bypass: no pi_old forward


def test_feature_table_covers_every_grpo_config_field():
    """Each GRPOConfig field of TRL 1.16 (not inherited from TrainingArguments) appears in some row."""
    import dataclasses

    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited]
    named = " ".join(f.name for f in FEATURES) + " " + " ".join(k for f in FEATURES for k in f.config)
    missing = [name for name in own if name not in named and name.split("_")[0] + "_*" not in named]
    # prefix-grouped rows ("vllm_server_*", "sapo_temperature_*", "vespo_*") cover their fields
    grouped = ("vllm_server_", "sapo_temperature_", "vespo_", "entropy_coef_")
    missing = [name for name in missing if not name.startswith(grouped)]
    assert missing == []
