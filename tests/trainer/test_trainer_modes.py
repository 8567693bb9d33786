"""RolloutCorrGRPOTrainer end to end on tiny random models (CPU, no downloads): every mode trains and logs,
numerics, forward counts, the rollout_func engine path, RS-rejected rows, hand-computed losses, errors."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOTrainer

from oracles import decoupled_policy_loss
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr import compute_rollout_correction
from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer


def cfg_is_bypass(overrides) -> bool:
    preset = overrides.get("rollout_corr_preset", "")
    return preset.startswith(("bypass", "direct")) or bool(overrides.get("bypass_mode"))


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
    "direct_double_sided": ("llama_dir", dict(rollout_corr_preset="direct_double_sided", beta=0.04, top_p=0.9),
                            True, False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_and_logs(mode, request, tmp_path, make_trainer, step_logs):
    fixture, overrides, has_is, has_rs = MODES[mode]
    trainer = make_trainer(request.getfixturevalue(fixture), tmp_path, max_steps=4, **overrides)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 4 and all(math.isfinite(log["loss"]) for log in logs)
    # decoupled: one correction per generation batch, logged at the step that generated it (num_iterations=2:
    # every other step); bypass: every micro-batch contributes
    corr_logs = [log for log in logs if "rollout_corr/num_valid_tokens" in log]
    assert len(corr_logs) == 4 // overrides.get("num_iterations", 1)
    for log in corr_logs:
        if log["rollout_corr/num_valid_tokens"] == 0:  # mask_truncated_completions can leave a step no token:
            assert "rollout_corr/kl" not in log  # absent (docs/how-to/read-the-metrics.md), never 0.0
            continue
        for key in OFFPOLICY_KEYS + ("num_valid_tokens", "invalid_token_fraction"):
            assert math.isfinite(log[f"rollout_corr/{key}"]), key
        assert all(f"rollout_corr/{k}" in log for k in IS_KEYS) == has_is
        assert ("rollout_corr/rollout_rs_masked_fraction" in log) == has_rs
    if not overrides.get("mask_truncated_completions"):  # with it, a step may keep no token at all
        assert all(log["rollout_corr/num_valid_tokens"] > 0 for log in corr_logs)
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


def test_logging_window_aggregates_every_step_exactly(llama_dir, tmp_path, make_trainer, step_logs):
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
def test_decoupled_other_loss_types_train(loss_type, llama_dir, tmp_path, make_trainer, step_logs):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_geo_rs_token_tis", loss_type=loss_type,
                           rollout_rs_threshold="0.9_1.1", top_p=0.95, max_steps=2, beta=0.04)
    trainer.train()
    for log in step_logs(trainer):
        assert math.isfinite(log["loss"]) and math.isfinite(log["kl"])
        assert 0.0 <= log["rollout_corr/rollout_rs_masked_fraction"] <= 1.0


@pytest.mark.parametrize("preset", ["decoupled_token_is", "bypass_pg_is"])
def test_eval_logs_prefixed_rollout_corr_metrics(preset, llama_dir, tmp_path, make_args):
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


def test_ratio_quantiles_are_exact_order_statistics(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is")
    trainer.model.train()
    values = torch.arange(1.0, 102.0)  # ratios 1..101 in three micro-batches
    for part in (values[:10], values[10:60], values[60:]):
        trainer.rollout_corr_metrics.add_log_ratios("train", {"engine": part.log()})
    logs = {}
    trainer.log(logs)
    assert logs["rollout_corr/engine_ratio_mean"] == pytest.approx(51.0)
    assert logs["rollout_corr/engine_ratio_p01"] == pytest.approx(2.0)  # position 0.01 * 100 = 1
    assert logs["rollout_corr/engine_ratio_p50"] == pytest.approx(51.0)
    assert logs["rollout_corr/engine_ratio_p99"] == pytest.approx(100.0)
    assert logs["rollout_corr/engine_ratio_max"] == pytest.approx(101.0)
    assert torch.quantile(values.double(), 0.99).item() == pytest.approx(100.0)


@pytest.mark.slow
def test_compiled_correction_gives_the_same_metrics(llama_dir, tmp_path, make_trainer, step_logs):
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
def test_identical_numerics_give_unit_weights(llama_dir, tmp_path, make_trainer, step_logs):
    """float32 generate, temperature 1, no top-p/top-k: mu == pi_old up to float noise."""
    runs = (("decoupled_k3_rs_token_tis", 1.0), ("bypass_pg_is", 1.0), ("decoupled_token_is", 0.7))
    for preset, temperature in runs:
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
def test_real_mismatch_shows_in_metrics(how, llama_dir, tmp_path, make_trainer, step_logs):
    if how == "top_p":
        trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", top_p=0.8, max_steps=2)
    elif how == "repetition_penalty":
        # the sampler penalises repeats, the trainer's pi_old does not
        trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", repetition_penalty=2.0,
                               max_steps=2)
    else:
        trainer = make_trainer(llama_dir, tmp_path, rollout_generate_dtype="bfloat16",
                               rollout_corr_preset="decoupled_token_is", max_steps=2)
    trainer.train()
    for log in step_logs(trainer):
        if how == "top_p":
            # truncating the tail raises log mu above log pi_old for every sampled token:
            # kl = mean(log mu - log pi) > 0
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
def test_bypass_runs_one_forward_fewer_per_generation_batch(num_iterations, llama_dir, tmp_path, make_trainer):
    max_steps = 4
    counts = {}
    for preset, old_forward in (("decoupled_token_is", "always"), ("decoupled_token_is", "auto"),
                                ("bypass_ppo_clip", "auto")):
        trainer = make_trainer(llama_dir, tmp_path / f"{preset}_{old_forward}", rollout_corr_preset=preset,
                               max_steps=max_steps, num_iterations=num_iterations,
                               rollout_corr_old_forward=old_forward)
        counter = count_training_forwards(trainer)
        trainer.train()
        counts[preset, old_forward] = counter["n"]
    generation_batches = max_steps // num_iterations
    # one loss forward per micro-batch (GA=1: one per step), plus pi_old once per generation batch in decoupled mode
    # with its own forward; read from the first loss forward (the default here), decoupled runs as many as bypass
    assert counts["bypass_ppo_clip", "auto"] == max_steps
    assert counts["decoupled_token_is", "always"] == max_steps + generation_batches
    assert counts["decoupled_token_is", "auto"] == max_steps


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
        pad = torch.tensor([width - len(ids) for ids in prompt_ids])
        attention = (torch.arange(width)[None, :] >= pad[:, None]).long()
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


def test_rollout_func_engine_path_is_aligned_token_for_token(llama_dir, tmp_path, monkeypatch, make_args, step_logs):
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


def test_rejected_rows_end_to_end(llama_dir, tmp_path, make_trainer):
    """top_p 0.8 + tight seq_mean_k3 RS: every fully rejected row carries advantage 0 into the loss."""
    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _compute_loss(self, model, inputs):  # the batch once the correction ran (at the loss with pi_old elided)
            loss = super()._compute_loss(model, inputs)
            seen.append(inputs)
            return loss

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


def test_decoupled_loss_equals_hand_computed_value(llama_dir, tmp_path, make_trainer, loss_inputs):
    trainer = make_trainer(llama_dir, tmp_path, rollout_is="token", rollout_is_threshold="2.0",
                           rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    # engine ratio pi_old / mu and update ratio pi_theta / pi_old per token (third token of row 1 is padding)
    inputs, logp, log_engine = loss_inputs(trainer, [[3.0, 1.5, 0.8], [1.2, 0.25, 1.0]], [1.0, -0.5])
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


def test_bypass_losses_equal_hand_computed_values(llama_dir, tmp_path, make_trainer, loss_inputs):
    # PPO clip on pi_theta / mu with token_k1 RS [0.5, 2]
    trainer = make_trainer(llama_dir, tmp_path / "ppo", rollout_corr_preset="bypass_ppo_clip",
                           rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", rollout_is="token", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, logp, log_direct = loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    inputs["rollout_log_probs"] = logp - log_direct
    loss = trainer._compute_loss(trainer.model, inputs)
    # keep [0,1,1], [1,1,-]; row0: -1.1, -min(.7,.8)=-.7 -> -.9 ; row1 (A=-.5): .45, -min(-.65,-.6)=.65 -> .55
    assert loss.item() == pytest.approx((-0.9 + 0.55) / 2, abs=1e-5)
    # dapo in bypass: normalised by the pre-RS token count of the global batch (5), as verl's engine workers
    trainer.loss_type = "dapo"
    assert trainer._compute_loss(trainer.model, inputs).item() == pytest.approx(
        (-1.1 - 0.7 + 0.45 + 0.65) / 5, abs=1e-5)
    trainer.rollout_corr_metrics.flush("train")
    trainer.loss_type = "grpo"
    trainer._compute_loss(trainer.model, inputs)
    metrics = trainer.rollout_corr_metrics.flush("train")
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    # IS weights are computed for metrics only (not multiplied in): mean of min(R, 2) over the 5 valid tokens
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1.1 + 0.7 + 0.9 + 1.3) / 5, abs=1e-5)

    # TRL's clip_ratio/low_min and high_max (issue 44): per row, the fraction of its kept tokens clipped; min / max
    # over rows. epsilon 0.2: low clip ratio < 0.8 with A < 0, high clip ratio > 1.2 with A > 0.
    for ratios, advantages, key, expected in [
        ([[0.7, 1.1, 0.6], [0.6, 1.3, 1.0]], [-1.0, -0.5], "clip_ratio/low_min", 0.5),  # rows: 2/3, 1/2
        ([[1.5, 1.1, 1.3], [1.25, 0.9, 1.0]], [1.0, 0.5], "clip_ratio/high_max", 2 / 3),  # rows: 2/3, 1/2
    ]:
        inputs, logp, log_direct = loss_inputs(trainer, ratios, advantages)
        inputs["rollout_log_probs"] = logp - log_direct
        trainer._metrics["train"].clear()
        trainer._compute_loss(trainer.model, inputs)
        assert trainer._metrics["train"][key] == [pytest.approx(expected, abs=1e-6)], key
        other = "clip_ratio/high_max" if key.endswith("low_min") else "clip_ratio/low_min"
        assert trainer._metrics["train"][other] == [0.0]

    # REINFORCE with sequence TIS (U=2): -A * w * log pi_theta
    trainer = make_trainer(llama_dir, tmp_path / "pg", rollout_corr_preset="bypass_pg_is", loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, logp, log_direct = loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    inputs["rollout_log_probs"] = logp - log_direct
    loss = trainer._compute_loss(trainer.model, inputs)
    w0, w1 = min(3.0 * 1.1 * 0.7, 2.0), 0.9 * 1.3
    expected = (-(1.0 * w0 * logp[0, :3]).sum() / 3 + (0.5 * w1 * logp[1, :2]).sum() / 2) / 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------- errors
def test_missing_or_misaligned_behaviour_log_probs_are_errors(llama_dir, tmp_path, monkeypatch, make_trainer):
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



@pytest.mark.parametrize("preset, mode", [(None, "diagnostics"), ("decoupled_token_is", "decoupled"),
                                          ("bypass_ppo_clip", "bypass")])
def test_records_name_the_mode_that_runs(preset, mode, llama_dir, tmp_path, make_trainer):
    """run.json's correction mode is the trainer's mode: a run with no correction is not recorded as "decoupled"
    (issue 48)."""
    import json

    overrides = {} if preset is None else dict(rollout_corr_preset=preset)
    trainer = make_trainer(llama_dir, tmp_path, rollout_dump_dir=str(tmp_path / "dump"), **overrides)
    run = json.loads((tmp_path / "dump" / "run.json").read_text())
    assert run["correction"]["mode"] == mode == trainer.rollout_corr_mode.name
