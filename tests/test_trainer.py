"""End-to-end and unit tests of RolloutCorrGRPOTrainer on tiny random models (CPU, no downloads)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import bf16_generate_trainer_class, make_tiny_model_dir, prompt_dataset, reward_len  # noqa: E402

BF16GenerateTrainer = bf16_generate_trainer_class()

import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_rollout_corr import compute_rollout_correction  # noqa: E402
from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs  # noqa: E402
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")), "llama", seed=0)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2", seed=1)


def cfg_is_bypass(overrides) -> bool:
    preset = overrides.get("rollout_corr_preset", "")
    return preset.startswith(("bypass", "direct")) or bool(overrides.get("bypass_mode"))


def make_args(tmp_path, **overrides) -> RolloutCorrGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        learning_rate=1e-3,
        save_strategy="no",
        beta=0.0,
        seed=0,
        disable_tqdm=True,
        bf16=False,  # TRL defaults to bf16 autocast (also on CPU); the tests train in float32 unless they say otherwise
    )
    kwargs.update(overrides)
    return RolloutCorrGRPOConfig(**kwargs)


def make_trainer(model_dir, tmp_path, trainer_cls=RolloutCorrGRPOTrainer, reward_funcs=reward_len, **overrides):
    args = make_args(tmp_path, **overrides)
    return trainer_cls(model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=prompt_dataset(8))


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


IS_KEYS = ("rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size")
OFFPOLICY_KEYS = (
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
)


# ---------------------------------------------------------------------------------------------- every mode trains
MODES = {
    # name: (model fixture, config overrides, expects IS keys, expects RS keys)
    "decoupled_tis": ("llama_dir", dict(rollout_corr_preset="decoupled_token_is", loss_type="grpo",
                                        gradient_accumulation_steps=2), True, False),
    "decoupled_icepop_rs": (
        "qwen_dir",
        dict(rollout_corr_preset="decoupled_token_icepop", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.5",
             loss_type="dapo", beta=0.04, num_iterations=2),
        True, True,
    ),
    "bypass_ppo_clip": ("llama_dir", dict(rollout_corr_preset="bypass_ppo_clip_k3_rs", rollout_rs_threshold="0.5",
                                          loss_type="dr_grpo", gradient_accumulation_steps=2,
                                          mask_truncated_completions=True), False, True),
    "bypass_reinforce_seq_is": ("qwen_dir", dict(rollout_corr_preset="bypass_pg_is", loss_type="bnpo",
                                                 steps_per_generation=2), True, False),
    "direct_double_sided": ("llama_dir", dict(rollout_corr_preset="direct_double_sided", beta=0.04, top_p=0.9), True, False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_and_logs(mode, request, tmp_path):
    fixture, overrides, has_is, has_rs = MODES[mode]
    trainer = make_trainer(request.getfixturevalue(fixture), tmp_path, max_steps=4, **overrides)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 4 and all(math.isfinite(log["loss"]) for log in logs)
    # decoupled: one correction per generation batch, logged at the step that generated it (num_iterations=2:
    # every other step); bypass: every micro-batch contributes
    corr_logs = [log for log in logs if "rollout_corr/kl" in log]
    assert len(corr_logs) == 4 // overrides.get("num_iterations", 1)
    for log in corr_logs:
        for key in OFFPOLICY_KEYS + ("num_valid_tokens", "invalid_token_fraction"):
            assert math.isfinite(log[f"rollout_corr/{key}"]), key
        assert all(f"rollout_corr/{k}" in log for k in IS_KEYS) == has_is
        assert ("rollout_corr/rollout_rs_masked_fraction" in log) == has_rs
        if not overrides.get("mask_truncated_completions"):  # with it, a step may keep no token at all: still finite
            assert log["rollout_corr/num_valid_tokens"] > 0
    if overrides.get("num_iterations", 1) > 1:  # second pass over a generation batch: pi_theta has moved from pi_old
        assert max(log["rollout_corr/update_ratio_max"] for log in logs) > 1.0 + 1e-3
    if not cfg_is_bypass(overrides):
        for log in logs:  # direct = engine * update per token, so the logged quantiles are ordered ratios
            for name in ("engine", "update", "direct"):
                v = [log[f"rollout_corr/{name}_ratio_{q}"] for q in ("p01", "p50", "p99", "max")]
                assert v == sorted(v) and v[0] > 0
    # policy lag in optimizer steps: data generated for step k and reused at step k+1 (num_iterations=2, or
    # steps_per_generation=2 with no accumulation) has lag 1
    reused = overrides.get("num_iterations", 1) > 1 or overrides.get("steps_per_generation", 1) > 1
    assert [log["rollout_corr/policy_lag_mean"] for log in logs] == ([0.0, 1.0, 0.0, 1.0] if reused else [0.0] * 4)
    # the flat fields and the effective correction agree with the preset
    cfg = trainer.rollout_correction
    assert cfg.bypass_mode == mode.startswith(("bypass", "direct"))
    assert trainer.args.vllm_importance_sampling_correction is False


def test_logging_window_aggregates_every_step_exactly(llama_dir, tmp_path):
    """logging_steps=2: one record per two steps, over all their tokens (not the mean of two per-step values)."""
    for preset in ("decoupled_token_is", "bypass_pg_is"):
        trainer = make_trainer(llama_dir, tmp_path / preset, rollout_corr_preset=preset, max_steps=4, logging_steps=2,
                               top_p=0.9)
        trainer.train()
        logs = step_logs(trainer)
        assert [log["step"] for log in logs] == [2, 4]
        for log in logs:
            # TRL averages completions/mean_length over the two steps (4 rows each): tokens = mean * 8 rows
            assert log["rollout_corr/num_valid_tokens"] == pytest.approx(log["completions/mean_length"] * 8)
            assert log["rollout_corr/num_valid_seqs"] == 8


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo"])
def test_decoupled_other_loss_types_train(loss_type, llama_dir, tmp_path):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_geo_rs_token_tis", loss_type=loss_type,
                           rollout_rs_threshold="0.9_1.1", top_p=0.95, max_steps=2, beta=0.04)
    trainer.train()
    for log in step_logs(trainer):
        assert math.isfinite(log["loss"]) and math.isfinite(log["kl"])
        assert 0.0 <= log["rollout_corr/rollout_rs_masked_fraction"] <= 1.0


@pytest.mark.parametrize("preset", ["decoupled_token_is", "bypass_pg_is"])
def test_eval_logs_prefixed_rollout_corr_metrics(preset, llama_dir, tmp_path):
    args = make_args(tmp_path, rollout_corr_preset=preset, max_steps=2, eval_strategy="steps",
                     eval_steps=2, per_device_eval_batch_size=4)
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), eval_dataset=prompt_dataset(4))
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 1
    assert evals[0]["eval_rollout_corr/num_valid_tokens"] > 0
    assert abs(evals[0]["eval_rollout_corr/kl"]) < 1e-6  # float32 both sides, no truncation
    assert not any(k.startswith("rollout_corr/") for k in evals[0])


def test_ratio_quantiles_are_exact_order_statistics(llama_dir, tmp_path):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is")
    trainer.model.train()
    values = torch.arange(1.0, 102.0)  # ratios 1..101 in three micro-batches
    for part in (values[:10], values[10:60], values[60:]):
        trainer._rc_record_ratios({"engine": part.log()})
    logs = {}
    trainer.log(logs)
    assert logs["rollout_corr/engine_ratio_mean"] == pytest.approx(51.0)
    assert logs["rollout_corr/engine_ratio_p01"] == pytest.approx(2.0)  # position 0.01 * 100 = 1
    assert logs["rollout_corr/engine_ratio_p50"] == pytest.approx(51.0)
    assert logs["rollout_corr/engine_ratio_p99"] == pytest.approx(100.0)
    assert logs["rollout_corr/engine_ratio_max"] == pytest.approx(101.0)
    assert torch.quantile(values.double(), 0.99).item() == pytest.approx(100.0)


@pytest.mark.slow
def test_compiled_correction_gives_the_same_metrics(llama_dir, tmp_path):
    """rollout_corr_compile=True: torch.compile'd correction, same logged values as the eager run (same seed)."""
    logs = {}
    for compile_ in (False, True):
        trainer = make_trainer(llama_dir, tmp_path / str(compile_), rollout_corr_preset="decoupled_k3_rs_token_tis",
                               rollout_rs_threshold="0.05", top_p=0.9, max_steps=2, rollout_corr_compile=compile_)
        trainer.train()
        logs[compile_] = step_logs(trainer)
    for eager, compiled in zip(logs[False], logs[True]):
        keys = [k for k in eager if k.startswith("rollout_corr/")]
        assert keys and set(keys) <= set(compiled)
        for key in keys:
            assert compiled[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-5), key  # fused float32 rounding
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------- numerics
def test_identical_numerics_give_unit_weights(llama_dir, tmp_path):
    """float32 generate, temperature 1, no top-p/top-k: mu == pi_old up to float noise."""
    for preset, temperature in (("decoupled_k3_rs_token_tis", 1.0), ("bypass_pg_is", 1.0), ("decoupled_token_is", 0.7)):
        # temperature is applied on both sides (processed scores / TRL's temperature-scaled log-probs)
        trainer = make_trainer(llama_dir, tmp_path / f"{preset}{temperature}", rollout_corr_preset=preset,
                               max_steps=2, temperature=temperature)
        trainer.train()
        for log in step_logs(trainer):
            assert abs(log["rollout_corr/kl"]) < 1e-6
            assert abs(log["rollout_corr/k3_kl"]) < 1e-6
            assert log["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
            assert log["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-5)
            assert log["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-5)
            if "rs" in preset:
                assert log["rollout_corr/rollout_rs_masked_fraction"] == 0.0
            names = ("direct",) if preset.startswith("bypass") else ("engine", "update", "direct")
            for name in names:  # ratio decomposition of the trained tokens: all ratios 1
                for q in ("mean", "p01", "p50", "p99", "max"):
                    assert log[f"rollout_corr/{name}_ratio_{q}"] == pytest.approx(1.0, abs=1e-5), (name, q)
            assert log["rollout_corr/invalid_token_fraction"] == 0.0


@pytest.mark.parametrize("how", ["top_p", "bf16", "repetition_penalty"])
def test_real_mismatch_shows_in_metrics(how, llama_dir, tmp_path):
    if how == "top_p":
        trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", top_p=0.8, max_steps=2)
    elif how == "repetition_penalty":
        # the sampler penalises repeats, the trainer's pi_old does not
        trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", repetition_penalty=2.0,
                               max_steps=2)
    else:
        trainer = make_trainer(llama_dir, tmp_path, trainer_cls=BF16GenerateTrainer,
                               rollout_corr_preset="decoupled_token_is", max_steps=2)
    trainer.train()
    for log in step_logs(trainer):
        if how == "top_p":
            # truncating the tail raises log mu above log pi_old for every sampled token: kl = mean(log mu - log pi) > 0
            assert log["rollout_corr/kl"] > 1e-2
            assert log["rollout_corr/rollout_is_max"] < 1.0  # pi_old / mu < 1 for every kept token
        elif how == "repetition_penalty":
            # measured on this model: kl 0.36 / 0.65, k3_kl 0.17 / 0.39, min IS ratio 0.08 / 0.02
            assert log["rollout_corr/kl"] > 0.05
            assert log["rollout_corr/k3_kl"] > 1e-2
            assert log["rollout_corr/rollout_is_min"] < 0.5
        else:
            assert log["rollout_corr/log_ppl_abs_diff"] > 1e-4
            # bf16 rounding of the logits: about 1e-2 relative spread of the token IS ratios on this model
            assert log["rollout_corr/rollout_is_std"] > 1e-3
            assert log["rollout_corr/rollout_is_max"] - log["rollout_corr/rollout_is_min"] > 1e-2
            assert log["rollout_corr/k3_kl"] > 1e-5


# ---------------------------------------------------------------------------------------------- forward count
def count_training_forwards(trainer):
    """Counts policy forwards that compute training log-probs (TRL passes fused_lm_head=True; generate does not)."""
    counter = {"n": 0}

    def hook(module, args, kwargs):
        if kwargs.get("fused_lm_head"):
            counter["n"] += 1

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return counter


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_bypass_runs_one_forward_fewer_per_generation_batch(num_iterations, llama_dir, tmp_path):
    max_steps = 4
    counts = {}
    for preset in ("decoupled_token_is", "bypass_ppo_clip"):
        trainer = make_trainer(llama_dir, tmp_path / preset, rollout_corr_preset=preset, max_steps=max_steps,
                               num_iterations=num_iterations)
        counter = count_training_forwards(trainer)
        trainer.train()
        counts[preset] = counter["n"]
    generation_batches = max_steps // num_iterations
    # one loss forward per micro-batch (GA=1: one per step), plus pi_old once per generation batch in decoupled mode
    assert counts["bypass_ppo_clip"] == max_steps
    assert counts["decoupled_token_is"] == max_steps + generation_batches


def _engine_rollout_func(shift: int = 0):
    """A rollout_func (the vLLM-style path: per-row lists of sampled-token log-probs) backed by HF generate.

    ``shift=1`` returns each row's log-probs shifted by one token (a misaligned engine) to show it is visible.
    """

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [tok(text=p)["input_ids"] for p in prompts]
        model = trainer.accelerator.unwrap_model(trainer.model)
        width = max(len(ids) for ids in prompt_ids)
        batch = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids])
        attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(ids) for ids in prompt_ids])[:, None]).long()
        was_training = model.training
        model.eval()  # as TRL's unwrap_model_for_generation: gradient checkpointing (train mode) breaks the KV cache
        with torch.no_grad(), capture_generate_log_probs(model) as capture:
            seqs = model.generate(input_ids=batch, attention_mask=attention, do_sample=True, max_new_tokens=8,
                                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id)
        model.train(was_training)
        completions = []
        for row in seqs[:, width:].tolist():
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            completions.append(row[:cut])
        logprobs = capture.completion_log_probs(completions)
        if shift:
            logprobs = [lp[shift:] + lp[:shift] for lp in logprobs]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}

    return rollout


def test_rollout_func_engine_path_is_aligned_token_for_token(llama_dir, tmp_path, monkeypatch):
    """The engine path (TRL pads per-row log-prob lists into sampling_per_token_logps, as for vLLM): with identical
    numerics kl is 0 to 1e-6; the same engine off by one token shows a large mismatch."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    results = {}
    for shift in (0, 1):
        args = make_args(tmp_path / str(shift), rollout_corr_preset="decoupled_token_is", max_steps=2)
        trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                         train_dataset=prompt_dataset(8), rollout_func=_engine_rollout_func(shift))
        trainer.train()
        # per-token statistics (a rotation within a row leaves row sums, kl and the log-ppl metrics unchanged)
        results[shift] = [log["rollout_corr/k3_kl"] for log in step_logs(trainer)]
        if shift == 0:
            assert max(abs(log["rollout_corr/kl"]) for log in step_logs(trainer)) < 1e-6
            assert max(results[0]) < 1e-6
    assert min(results[1]) > 1e-2


# ---------------------------------------------------------------------------------------------- advantages
def test_fully_rejected_row_gets_zero_advantage_and_leaves_baseline(llama_dir, tmp_path):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_k3_rs")
    rewards = torch.tensor([[1.0], [0.0], [1.0], [5.0], [2.0], [2.0], [0.0], [4.0]])
    excluded = torch.tensor([False, False, False, True, False, False, False, False])
    adv = trainer._rc_group_advantages(rewards, excluded, num_generations=4)
    # group 0 without row 3: rewards [1, 0, 1], mean 2/3, unbiased std 0.577350
    std0 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    expected0 = [(1 - 2 / 3) / (std0 + 1e-4), (0 - 2 / 3) / (std0 + 1e-4), (1 - 2 / 3) / (std0 + 1e-4), 0.0]
    torch.testing.assert_close(adv[:4], torch.tensor(expected0), atol=1e-6, rtol=0)
    # the baseline equals that of the group without the row at all
    alone = trainer._rc_group_advantages(torch.tensor([[1.0], [0.0], [1.0]]), torch.zeros(3, dtype=torch.bool), 3)
    torch.testing.assert_close(adv[:3], alone)
    # group 1 untouched: rewards [2, 2, 0, 4], mean 2, std sqrt(8/3)
    std1 = math.sqrt(8 / 3)
    torch.testing.assert_close(adv[4:], torch.tensor([0.0, 0.0, -2 / (std1 + 1e-4), 2 / (std1 + 1e-4)]), atol=1e-6, rtol=0)

    # through _rc_advantages (local slice, single rank) with and without keeping the row in the baseline
    trainer._rc_rewards = rewards
    trl_adv = trainer._rc_group_advantages(rewards, torch.zeros(8, dtype=torch.bool), 4)
    torch.testing.assert_close(trainer._rc_advantages(trl_adv, excluded, "train"), adv)
    trainer.args.rs_keep_rejected_in_baseline = True
    kept = trainer._rc_advantages(trl_adv, excluded, "train")
    assert kept[3] == 0.0
    torch.testing.assert_close(kept[:3], trl_adv[:3])  # verl: rejected row still shapes the baseline
    trainer.args.rs_keep_rejected_in_baseline = False
    # nothing rejected anywhere: TRL's advantages are returned as they are
    assert trainer._rc_advantages(trl_adv, torch.zeros(8, dtype=torch.bool), "train") is trl_adv


def test_rejected_rows_end_to_end(llama_dir, tmp_path):
    """top_p 0.8 + tight seq_mean_k3 RS: every fully rejected row carries advantage 0 into the loss."""
    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append(out)
            return out

    trainer = make_trainer(llama_dir, tmp_path, trainer_cls=Spy, rollout_corr_preset="decoupled_k3_rs",
                           rollout_rs_threshold="0.01", top_p=0.8, max_steps=3)
    trainer.train()
    total_rejected = 0
    for out in seen:
        rejected = (out["completion_mask"].sum(1) > 0) & (out["rollout_rs_mask"].sum(1) == 0)
        total_rejected += int(rejected.sum())
        assert torch.all(out["advantages"][rejected] == 0)
        assert int(out["num_items_in_batch"]) == int(out["rollout_rs_mask"].sum())
    assert total_rejected > 0


# ---------------------------------------------------------------------------------------------- hand-computed losses
def _loss_inputs(trainer, log_ratio_rows, advantages):
    """A 2-row micro-batch; returns (inputs, pi_theta log-probs) with mask [[1,1,1],[1,1,0]]."""
    prompt_ids = torch.tensor([[2, 10, 11], [2, 12, 13]])
    completion_ids = torch.tensor([[14, 15, 16], [17, 18, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], 1), 3)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor(advantages),
                  num_items_in_batch=completion_mask.sum())
    return inputs, logp.float(), torch.tensor(log_ratio_rows).log()


def test_decoupled_loss_equals_hand_computed_value(llama_dir, tmp_path):
    trainer = make_trainer(llama_dir, tmp_path, rollout_is="token", rollout_is_threshold="2.0",
                           rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    # engine ratio pi_old / mu and update ratio pi_theta / pi_old per token (third token of row 1 is padding)
    inputs, logp, log_engine = _loss_inputs(trainer, [[3.0, 1.5, 0.8], [1.2, 0.25, 1.0]], [1.0, -0.5])
    log_update = torch.tensor([[1.5, 1.1, 0.7], [0.9, 1.3, 1.0]]).log()
    old = logp - log_update
    mu = old - log_engine
    mask = inputs["completion_mask"]
    out = compute_rollout_correction(old, mu, mask, trainer.rollout_correction)
    # as _generate_and_score_completions does: RS mask, IS weights, kept-token count for dapo
    inputs.update(old_per_token_logps=old, rollout_log_probs=mu, rollout_rs_mask=out.response_mask,
                  rollout_is_weights=out.weights, num_items_in_batch=out.response_mask.sum())
    loss = trainer._compute_loss(trainer.model, inputs)
    # RS keeps ratios in [0.5, 2]: row0 [0,1,1], row1 [1,0,-]; TIS weights min(R, 2): [2, 1.5, .8], [1.2, .25, -]
    # row0: t1 -min(1.1, 1.1)*1.5 = -1.65, t2 -min(.7, .8)*.8 = -.56 -> mean -1.105
    # row1 (A=-.5): t0 -min(-.45, -.45)*1.2 = .54 -> mean .54 ; grpo loss = mean over rows = -.2825
    assert loss.item() == pytest.approx(-0.2825, abs=1e-5)
    # gradient: equal to that of the reference decoupled loss (oracles.decoupled_policy_loss: W times the clipped
    # PPO loss) aggregated as TRL's grpo
    from oracles import decoupled_policy_loss

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(trainer._compute_loss(trainer.model, inputs), params)
    lp, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], mask], 1), 3)
    ref = decoupled_policy_loss(lp, old, inputs["advantages"], out.response_mask, out.weights)
    keep = ref.mask
    ref_loss = (torch.where(keep, ref.per_token_loss, 0.0).sum(-1) / keep.sum(-1).clamp(min=1)).mean()
    assert ref_loss.item() == pytest.approx(-0.2825, abs=1e-5)
    for a, b in zip(grads, torch.autograd.grad(ref_loss, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # dapo: sum over kept tokens / kept tokens of the global batch (3)
    trainer.loss_type = "dapo"
    assert trainer._compute_loss(trainer.model, inputs).item() == pytest.approx((-1.65 - 0.56 + 0.54) / 3, abs=1e-5)


def test_bypass_losses_equal_hand_computed_values(llama_dir, tmp_path):
    # PPO clip on pi_theta / mu with token_k1 RS [0.5, 2]
    trainer = make_trainer(llama_dir, tmp_path / "ppo", rollout_corr_preset="bypass_ppo_clip",
                           rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", rollout_is="token", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, logp, log_direct = _loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    inputs["rollout_log_probs"] = logp - log_direct
    loss = trainer._compute_loss(trainer.model, inputs)
    # keep [0,1,1], [1,1,-]; row0: -1.1, -min(.7,.8)=-.7 -> -.9 ; row1 (A=-.5): .45, -min(-.65,-.6)=.65 -> .55
    assert loss.item() == pytest.approx((-0.9 + 0.55) / 2, abs=1e-5)
    # dapo in bypass: normalised by the pre-RS token count of the global batch (5), as verl's engine workers
    trainer.loss_type = "dapo"
    assert trainer._compute_loss(trainer.model, inputs).item() == pytest.approx((-1.1 - 0.7 + 0.45 + 0.65) / 5, abs=1e-5)
    trainer._rc_stats["train"] = None
    trainer.loss_type = "grpo"
    trainer._compute_loss(trainer.model, inputs)
    metrics = trainer._rc_stats["train"].finalize()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    # IS weights are computed for metrics only (not multiplied in): mean of min(R, 2) over the 5 valid tokens
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1.1 + 0.7 + 0.9 + 1.3) / 5, abs=1e-5)

    # REINFORCE with sequence TIS (U=2): -A * w * log pi_theta
    trainer = make_trainer(llama_dir, tmp_path / "pg", rollout_corr_preset="bypass_pg_is", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, logp, log_direct = _loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    inputs["rollout_log_probs"] = logp - log_direct
    loss = trainer._compute_loss(trainer.model, inputs)
    w0, w1 = min(3.0 * 1.1 * 0.7, 2.0), 0.9 * 1.3
    expected = (-(1.0 * w0 * logp[0, :3]).sum() / 3 + (0.5 * w1 * logp[1, :2]).sum() / 2) / 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_coupling_bypass_aggregation_matches_trl_loss(loss_type, llama_dir, tmp_path):
    """Bypass ppo_clip without IS/RS == TRL's own loss with old_per_token_logps := mu (incl. beta KL, bias-corrected)."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="bypass_ppo_clip", loss_type=loss_type, beta=0.04,
                           gradient_accumulation_steps=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs, logp, log_direct = _loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    mu = logp - log_direct
    inputs.update(rollout_log_probs=mu, ref_per_token_logps=logp + torch.tensor([[0.1, -0.2, 0.3], [0.05, 0.0, 0.0]]))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    ours = trainer._compute_loss(trainer.model, inputs)
    grads_ours = torch.autograd.grad(ours, params)
    theirs = GRPOTrainer._compute_loss(trainer, trainer.model, {**inputs, "old_per_token_logps": mu})
    grads_theirs = torch.autograd.grad(theirs, params)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- config, CLI, YAML
def test_config_preset_overrides_and_validation(tmp_path):
    args = make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.005")
    cfg = args.rollout_correction()
    assert (cfg.rollout_is, cfg.rollout_rs, cfg.rs_specs[0].upper) == ("token", "seq_mean_k3", 0.005)
    assert args.rollout_is_threshold == "2.0" and args.vllm_importance_sampling_correction is False
    no_is = make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_is="none")
    # a preset's IS switched off stays explicitly "none", so re-parsing the fields (YAML, checkpoint) keeps it off
    assert no_is.rollout_is == "none" and not no_is.rollout_correction().is_enabled and no_is.rollout_rs == "seq_mean_k3"
    fields = {k: getattr(no_is, k) for k in ("rollout_corr_preset", "rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")}
    assert make_args(tmp_path, **fields).rollout_correction() == no_is.rollout_correction()
    dds = make_args(tmp_path, rollout_corr_preset="direct_double_sided")
    assert dds.rollout_is_threshold == "0.8_1.2" and dds.bypass_loss_type == "reinforce" and dds.bypass_mode
    # diagnostics only: TRL's default vLLM correction stays on
    assert make_args(tmp_path).vllm_importance_sampling_correction is True
    with pytest.raises(ValueError, match="corrected twice"):
        make_args(tmp_path, rollout_is="token", vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="continuous_batching"):
        make_args(tmp_path, rollout_is="token", use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="loss_type"):
        make_args(tmp_path, bypass_mode=True, loss_type="cispo")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        make_args(tmp_path, bypass_mode=True, top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="vespo"):
        make_args(tmp_path, loss_type="vespo")
    with pytest.raises(ValueError, match="preset"):
        make_args(tmp_path, rollout_corr_preset="nope")
    with pytest.raises(ValueError):
        make_args(tmp_path, rollout_is="token", rollout_is_threshold="2_1")


def test_cli_flags_and_yaml_round_trip(tmp_path):
    import yaml
    from trl import TrlParser

    parser = TrlParser((RolloutCorrGRPOConfig,))
    (from_cli,) = parser.parse_args_and_config([
        "--output_dir", str(tmp_path), "--use_cpu", "--rollout_corr_preset", "decoupled_geo_rs_token_tis",
        "--rollout_is_threshold", "3.5", "--rollout_rs_threshold", "0.99_1.01", "--rs_keep_rejected_in_baseline",
        "--bypass_mode", "false",
    ])
    cfg = from_cli.rollout_correction()
    assert cfg.rollout_is == "token" and cfg.is_bounds.upper == 3.5
    assert (cfg.rs_specs[0].lower, cfg.rs_specs[0].upper) == (0.99, 1.01)
    assert from_cli.rs_keep_rejected_in_baseline is True and cfg.bypass_mode is False
    (bools,) = parser.parse_args_and_config([
        "--output_dir", str(tmp_path), "--use_cpu", "--rollout_is", "sequence", "--rollout_is_batch_normalize", "true",
        "--bypass_mode", "true", "--bypass_loss_type", "reinforce", "--vllm_importance_sampling_correction", "false",
    ])
    cfg = bools.rollout_correction()
    assert cfg.bypass_mode is True and cfg.rollout_is_batch_normalize is True and cfg.bypass_loss_type == "reinforce"
    assert bools.vllm_importance_sampling_correction is False

    names = ["rollout_corr_preset", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
             "rollout_rs_threshold", "bypass_mode", "bypass_loss_type", "rs_keep_rejected_in_baseline",
             "vllm_importance_sampling_correction"]
    # YAML written from the effective fields (to_dict) parses back to the same config
    for source in (from_cli, make_args(tmp_path, rollout_corr_preset="direct_double_sided")):
        d = source.to_dict()
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump({"output_dir": str(tmp_path), "use_cpu": True, **{k: d[k] for k in names}}))
        (from_yaml,) = parser.parse_args_and_config(["--config", str(path)])
        assert {k: getattr(from_yaml, k) for k in names} == {k: getattr(source, k) for k in names}
        assert from_yaml.rollout_correction() == source.rollout_correction()
    # a hand-written YAML with a float threshold and a quoted IcePop band
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nrollout_is: token\nrollout_is_threshold: '0.5_5.0'\n"
                    "rollout_rs: seq_mean_k3\nrollout_rs_threshold: 0.01\nbypass_mode: true\nbypass_loss_type: reinforce\n")
    (hand,) = parser.parse_args_and_config(["--config", str(path)])
    cfg = hand.rollout_correction()
    assert cfg.is_bounds.lower == 0.5 and cfg.rs_specs[0].upper == 0.01 and cfg.bypass_loss_type == "reinforce"


def test_checkpoint_save_and_resume(llama_dir, tmp_path):
    common = dict(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.3",
                  rs_keep_rejected_in_baseline=True, save_strategy="steps", save_steps=2)
    trainer = make_trainer(llama_dir, tmp_path, max_steps=2, **common)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    saved = torch.load(ckpt / "training_args.bin", weights_only=False)
    assert isinstance(saved, RolloutCorrGRPOConfig)
    assert saved.rollout_correction() == trainer.rollout_correction
    assert saved.rs_keep_rejected_in_baseline is True and saved.rollout_rs_threshold == "0.3"
    resumed = make_trainer(llama_dir, tmp_path, max_steps=4, **common)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    logs = step_logs(resumed)
    assert [h["step"] for h in logs][-2:] == [3, 4]
    assert all("rollout_corr/rollout_rs_masked_fraction" in h for h in logs[-2:])


# ---------------------------------------------------------------------------------------------- errors
def test_missing_or_misaligned_behaviour_log_probs_are_errors(llama_dir, tmp_path, monkeypatch):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is")
    real = GRPOTrainer._generate

    def drop_logprobs(self, prompts):
        out = list(real(self, prompts))
        out[4] = None
        return tuple(out)

    def shorten_row_2(self, prompts):
        out = list(real(self, prompts))
        out[4] = [list(lp) for lp in out[4]]
        out[4][2] = out[4][2] + [0.0]
        return tuple(out)

    monkeypatch.setattr(GRPOTrainer, "_generate", drop_logprobs)
    with pytest.raises(ValueError, match="no behaviour log-probs"):
        trainer.train()
    monkeypatch.setattr(GRPOTrainer, "_generate", shorten_row_2)
    with pytest.raises(ValueError, match="Row 2"):
        trainer.train()


def test_plain_grpo_config_is_refused(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="RolloutCorrGRPOConfig"):
        RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                               args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]))


# ---------------------------------------------------------------------------------------------- TRL coupling pins
def test_trl_coupling_version_and_signatures():
    assert trl.__version__.startswith("1.16."), "trainer.py's coupling block is written against trl 1.16"
    sig = {name: list(inspect.signature(getattr(GRPOTrainer, name)).parameters) for name in (
        "_generate_single_turn", "_generate", "_calculate_rewards", "_get_per_token_logps_and_entropies",
        "_generate_and_score_completions", "_compute_loss", "log")}
    assert sig["_generate_single_turn"] == ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]
    assert sig["_calculate_rewards"] == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert sig["_get_per_token_logps_and_entropies"][:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert sig["_compute_loss"] == ["self", "model", "inputs"]
    src_gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    src_loss = inspect.getsource(GRPOTrainer._compute_loss)
    src_single = inspect.getsource(GRPOTrainer._generate_single_turn)
    # (a)/(b): behaviour log-probs arrive as _generate()'s 5th value and become sampling_per_token_logps
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in src_gen
    assert "unwrapped_model.generate(" in src_single
    # (c): TRL's own pi_old rule, reproduced by _trl_computes_old_log_probs
    assert "self.args.gradient_accumulation_steps % generate_every != 0" in src_gen
    assert src_gen.index("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies") < src_gen.index(
        "ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies")
    # (d): rewards gathered, NaN rows excluded from the baseline, local slice by process index
    assert "self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in src_gen
    assert "advantages = torch.nan_to_num(advantages, nan=0.0)" in src_gen
    # (e): tool_mask enters only the loss mask; (B, T) advantages accepted; homogeneous clipped loss
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in src_loss
    assert "if advantages.dim() == 1:" in src_loss
    assert "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)" in src_loss
    assert src_loss.count("tool_mask") == 2  # both on that one line
    # transformers: the behaviour-log-prob recorder is appended to the list _get_logits_processor returns
    from transformers.generation.utils import GenerationMixin

    assert "generation_config" in inspect.signature(GenerationMixin._get_logits_processor).parameters


@pytest.mark.parametrize("setting", [
    dict(scale_rewards="group"), dict(scale_rewards="batch"), dict(scale_rewards="none"),
    dict(multi_objective_aggregation="normalize_then_sum"),
])
def test_trl_coupling_advantage_formula_matches_trl(setting, llama_dir, tmp_path):
    """With nothing rejected, our RS-aware advantage formula reproduces TRL's advantages exactly."""
    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append((out["advantages"].clone(), self._rc_rewards.clone()))
            return out

    def reward_digits(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    trainer = make_trainer(llama_dir, tmp_path, trainer_cls=Spy, reward_funcs=[reward_len, reward_digits],
                           rollout_corr_preset="decoupled_token_is", max_steps=2, **setting)
    trainer.train()
    for advantages, rewards in seen:
        ours = trainer._rc_group_advantages(rewards, torch.zeros(rewards.size(0), dtype=torch.bool), 4)
        torch.testing.assert_close(ours, advantages, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- two ranks on CPU
def _launch(nproc: int, out_json, model_dir, port: int, *extra: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           os.path.join(os.path.dirname(__file__), "dist_worker.py"), str(out_json), str(model_dir), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
    assert proc.returncode == 0, "\n".join(errors[-20:]) + proc.stderr[-3000:]
    return [json.load(open(f"{out_json}.rank{r}")) for r in range(nproc)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank(llama_dir, tmp_path):
    """torchrun --nproc_per_node 2 with use_cpu=True (real DDP over gloo) vs 1 rank, same global batch."""
    two = _launch(2, tmp_path / "two.json", llama_dir, _free_port())
    one = _launch(1, tmp_path / "one.json", llama_dir, _free_port())
    assert [r["world"] for r in two] == [2, 2] and one[0]["world"] == 1
    assert two[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    for case, ref in one[0]["exact"].items():
        got = two[0]["exact"][case]
        assert got == two[1]["exact"][case]  # every rank logs the same values
        assert set(got) == set(ref) and len(ref) > 20
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (case, key)
        # uneven shards: 10 + 1000 valid tokens, one of them NaN -> invalid
        assert ref["rollout_corr/num_valid_tokens"] == 1009
        assert ref["rollout_corr/invalid_token_fraction"] == pytest.approx(1 / 1010)
        assert got["rollout_corr/engine_ratio_p50"] == ref["rollout_corr/engine_ratio_p50"]  # exact order statistics
    # fully rejected rows across ranks: advantage 0, and the group baselines use only the kept rows of all ranks
    n_rejected = 0
    for gen0, gen1 in zip(two[0]["rs_rows"], two[1]["rs_rows"]):
        assert gen0["rewards"] == gen1["rewards"]
        rewards = gen0["rewards"]
        rejected = gen0["rejected"] + gen1["rejected"]
        advantages = gen0["advantages"] + gen1["advantages"]
        n_rejected += sum(rejected)
        for g in range(0, len(rewards), 4):
            kept = [rewards[i] for i in range(g, g + 4) if not rejected[i]]
            for i in range(g, g + 4):
                if rejected[i] or len(kept) < 2:
                    expected = 0.0
                else:
                    mean = sum(kept) / len(kept)
                    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / (len(kept) - 1))
                    expected = (rewards[i] - mean) / (std + 1e-4)
                assert advantages[i] == pytest.approx(expected, abs=1e-4), (g, i)
    assert n_rejected > 0
    # real 2-rank training: the logged token count is the global one (sum over ranks, not a mean of ranks)
    for preset, logs in two[0]["train"].items():
        assert len(logs) == 2
        for log in logs:
            assert math.isfinite(log["loss"])
            assert log["num_valid_tokens"] == pytest.approx(log["mean_length"] * log["global_rows"])
            assert log["global_rows"] == 8


def test_deepspeed_zero2_two_ranks_trains_logs_exactly_and_exits_cleanly(llama_dir, tmp_path):
    """ZeRO-2 DeepSpeedEngine on 2 CPU ranks (torchrun + deepspeed= config): exit code 0 on every rank, and the
    rollout_corr/* values equal the 1-rank values on the same global batch."""
    pytest.importorskip("deepspeed")
    two = _launch(2, tmp_path / "ds.json", llama_dir, _free_port(), "deepspeed")  # asserts returncode == 0
    one = _launch(1, tmp_path / "one.json", llama_dir, _free_port())
    assert two[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert set(two[0]["engine"].values()) == {"DeepSpeedEngine"}
    for case, ref in one[0]["exact"].items():
        got = two[0]["exact"][case]
        assert got == two[1]["exact"][case] and set(got) == set(ref)
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (case, key)
    for preset, logs in two[0]["train"].items():
        for log in logs:
            assert math.isfinite(log["loss"])
            assert log["num_valid_tokens"] == pytest.approx(log["mean_length"] * 8)
