"""Sampling-support matching in the trainer (``rollout_support_matching``) on tiny random models, float32 on both
sides so that the numerics agree: engine ratios at the kept mass without matching and at 1 with it, the start-up
report, the errors that name the fix, missed tokens, a finite-difference check of the loss through the normaliser,
and training runs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

from tiny_model import make_tiny_model, make_tiny_model_dir, prompt_dataset, reward_len

PROMPTS = [{"prompt": p} for p in ("1+3=", "2+4=", "3+5=", "4+6=")]
SUPPORT = "rollout_corr/support_"
_CORRECTION_FIELDS = ("rollout_corr_preset", "rollout_is", "rollout_rs", "bypass_mode")


@pytest.fixture
def make_trainer(make_trainer):
    """conftest's ``make_trainer`` with decoupled token TIS unless a test names its own correction: support matching
    is refused without a correction (TRL's GRPO runs unchanged then, issue 9), and the decoupled batch then carries
    pi_old as ``old_per_token_logps``."""

    def make(model_dir, tmp_path, **overrides):
        if not any(name in overrides for name in _CORRECTION_FIELDS):
            overrides["rollout_corr_preset"] = "decoupled_token_is"
        return make_trainer(model_dir, tmp_path, **overrides)

    return make


def _generation_batch(trainer, repeat=1):
    """One evaluation-mode generation batch (4 * repeat completions, groups of four) and TRL's full-vocabulary
    log-probs of its completions (the policy forward outside any support scope), and the flushed metrics."""
    trainer.model.eval()
    out = trainer._generate_and_score_completions(PROMPTS * repeat)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        full, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, out["completion_ids"].size(1))
    return out, full, trainer.rollout_corr_metrics.flush("eval")


@pytest.mark.parametrize("sampler", [dict(top_p=0.8), dict(top_k=20), dict(min_p=0.1)], ids=str)
@pytest.mark.parametrize("matching", ["off", "recompute", "replay"])
def test_engine_ratio_at_kept_mass_without_matching_and_one_with_it(sampler, matching, llama_dir, tmp_path,
                                                                    make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching=matching, **sampler)
    out, full, metrics = _generation_batch(trainer)
    valid = out["completion_mask"].bool()
    mu, old = out["rollout_log_probs"][valid], out["old_per_token_logps"][valid]
    unmatched = full[valid] - mu  # what TRL's log-probs give: log S per token
    assert unmatched.max() < 1e-5 and unmatched.mean() < -1e-3  # the engine ratio sits at the kept mass S < 1
    if matching == "off":
        assert torch.equal(old, full[valid])  # TRL's path, unchanged
        assert not any(k.startswith("eval_" + SUPPORT) for k in metrics)
        return
    assert (old - mu).abs().max() < 1e-5  # engine ratio 1 to 1e-5
    # the trainer's log kept mass is the whole gap, token for token (mean over the same tokens)
    assert metrics[f"eval_{SUPPORT}log_mass_mean"] == pytest.approx(unmatched.mean().item(), abs=1e-5)
    assert metrics[f"eval_{SUPPORT}miss_fraction"] == 0.0
    if "top_k" in sampler:
        assert metrics[f"eval_{SUPPORT}size_p50"] == 20.0 and metrics[f"eval_{SUPPORT}size_mean"] == 20.0


def test_no_truncation_scores_exactly_as_trls_fused_head(llama_dir, tmp_path, make_trainer, caplog):
    """Pins the LM-head semantics the support computation reproduces (TRL's add_fused_lm_head: last hidden state
    times the head, divided by the temperature): with nothing truncated, matched = TRL's log-probs. Accepted (this
    test needs it), with one start-up warning that the matching changes nothing and naming the fix."""
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.trainer"):
        trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching="recompute", temperature=0.7)
    noop = [r.getMessage() for r in caplog.records if "changes nothing here" in r.getMessage()]
    assert len(noop) == 1 and "\n" not in noop[0]
    assert noop[0].startswith("rollout_support_matching='recompute' changes nothing here: the engine truncates "
                              "nothing")
    assert "Set rollout_support_matching='off', or set the top_p / top_k / min_p" in noop[0]
    out, full, _ = _generation_batch(trainer)
    valid = out["completion_mask"].bool()
    torch.testing.assert_close(out["old_per_token_logps"][valid], full[valid], atol=2e-6, rtol=0)
    assert trainer.rollout_sampler.steps[0].name == "temperature" and not trainer.rollout_sampler.truncates


@pytest.mark.parametrize("sampler", [dict(top_p=0.8), dict(repetition_penalty=1.1)], ids=str)
def test_matching_that_changes_the_log_probs_gives_no_noop_warning(sampler, llama_dir, tmp_path, make_trainer,
                                                                   caplog):
    """The valid neighbours of the no-op warning: a truncation, or a penalty without truncation (matching applies it
    to the trainer's logits), start without it."""
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.trainer"):
        trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching="recompute", **sampler)
    assert trainer.rollout_sampler.steps and not trainer.rollout_sampler.matches_trl_scoring
    assert "changes nothing here" not in caplog.text


def test_startup_report_names_parameters_and_their_sources(tmp_path, make_trainer, caplog):
    model_dir = make_tiny_model_dir(str(tmp_path / "m"), "llama")
    config_path = Path(model_dir, "generation_config.json")
    config = json.loads(config_path.read_text())
    config.update(min_p=0.1, no_repeat_ngram_size=2)
    config_path.write_text(json.dumps(config))
    kwargs = dict(generation_kwargs={"temperature": 0.7, "top_k": 20})
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.trainer"):
        trainer = make_trainer(model_dir, tmp_path, **kwargs)
    report = trainer.rollout_sampler_report
    assert [line.split(" shapes")[0] for line in report] == [
        "temperature=0.7 (generation_kwargs)", "top_k=20 (generation_kwargs)", "min_p=0.1 (generation_config.json)",
        "no_repeat_ngram_size=2 (generation_config.json)"]
    assert all(line in caplog.text for line in report) and "rollout_support_matching='recompute'" in caplog.text
    # recompute cannot reproduce the n-gram block: refused, naming it and replay
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size=2 \(generation_config.json\).*'replay'"):
        make_trainer(model_dir, tmp_path, rollout_support_matching="recompute", **kwargs)
    # replay covers it (a set processor): the engine ratio is 1 again, where without matching it is far off
    off_out, off_full, _ = _generation_batch(trainer)
    replay = make_trainer(model_dir, tmp_path, rollout_support_matching="replay", **kwargs)
    assert replay.rollout_sampler_report == []
    out, _, metrics = _generation_batch(replay)
    valid, off_valid = out["completion_mask"].bool(), off_out["completion_mask"].bool()
    assert (out["old_per_token_logps"] - out["rollout_log_probs"])[valid].abs().max() < 1e-5
    off_kl = (off_out["rollout_log_probs"] - off_out["old_per_token_logps"])[off_valid].mean()
    assert off_kl > 0.1  # "reported as mismatch": rollout_corr/kl of the same setting without matching


def test_processors_generate_applies_are_checked_against_the_contract(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching="recompute", top_p=0.8)
    trainer.generation_config.top_p = 0.7  # generate now samples with something the contract does not say
    with pytest.raises(RuntimeError, match=r"generate applied \[\('top_p', 0.7"):
        _generation_batch(trainer)


class _RolloutFunc:
    """A rollout_func stand-in (never called): what the trainer asks of one at start-up."""

    def __init__(self, contract=None):
        if contract is not None:
            self.sampler_contract = lambda trainer: contract

    def __call__(self, prompts, trainer):  # pragma: no cover
        raise AssertionError("not called in these tests")


def test_replay_where_the_path_cannot_return_the_support_names_recompute(llama_dir, tmp_path, make_args):
    from trl_rollout_corr.support import sampler_from_vllm_params
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    def build(rollout_func, **overrides):
        args = make_args(tmp_path, rollout_corr_preset="decoupled_token_is", **overrides)
        return RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                      train_dataset=prompt_dataset(8), rollout_func=rollout_func)

    contract = sampler_from_vllm_params({"top_p": 0.9})
    with pytest.raises(ValueError, match=r"replay.*cannot return the engine's kept-token sets.*'recompute'"):
        build(_RolloutFunc(contract), rollout_support_matching="replay", top_p=0.9)
    trainer = build(_RolloutFunc(contract), rollout_support_matching="recompute", top_p=0.9)
    assert trainer.rollout_sampler is contract
    with pytest.raises(ValueError, match="declares no sampler.*sampler_contract"):
        build(_RolloutFunc(), rollout_support_matching="recompute")
    with pytest.raises(ValueError, match="rollout_support_matching must be one of"):
        make_args(tmp_path, rollout_support_matching="always")
    with pytest.raises(ValueError, match="no correction is configured.*rollout_support_matching='off'"):
        make_args(tmp_path, rollout_support_matching="recompute")  # TRL's GRPO, unchanged, without a correction


def test_missed_tokens_are_invalid_and_counted(llama_dir, tmp_path, make_trainer, step_logs):
    """Bypass mode, the samples used twice (num_iterations=2) after a large update: at the second use many sampled
    tokens fall outside pi_theta's recomputed top-p set. They are counted (support_miss_fraction), made invalid
    (invalid_token_fraction, out of the loss) and the loss stays finite."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching="recompute", top_p=0.5, max_steps=2,
                           num_iterations=2, learning_rate=3e-2, rollout_corr_preset="bypass_ppo_clip")
    trainer.train()
    first, second = step_logs(trainer)
    assert first[f"{SUPPORT}miss_fraction"] == 0.0  # on-policy: the engine's support is the trainer's
    assert second[f"{SUPPORT}miss_fraction"] > 0.1
    assert second["rollout_corr/invalid_token_fraction"] >= second[f"{SUPPORT}miss_fraction"]
    assert math.isfinite(second["loss"]) and math.isfinite(second["grad_norm"])


def _float64_trainer(tmp_path, make_args, matching):
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    model, tok = make_tiny_model("llama", seed=0)
    args = make_args(tmp_path, rollout_support_matching=matching, top_p=0.8, temperature=0.9,
                     rollout_corr_preset="decoupled_token_is")
    return RolloutCorrGRPOTrainer(model=model.double(), processing_class=tok, reward_funcs=reward_len, args=args,
                                  train_dataset=prompt_dataset(8))


def test_loss_gradient_through_the_normaliser_matches_finite_differences(tmp_path, make_args):
    """Float64 tiny model, top_p 0.8: the loss TRL computes from the support-matched pi_theta (decoupled mode),
    differentiated by autograd, equals central differences of the loss itself (head and backbone entries), and
    differs from the unmatched gradient (the normaliser's part)."""
    trainer = _float64_trainer(tmp_path, make_args, "recompute")
    trainer.model.eval()  # evaluation-mode loss normalisation (no gradient-accumulation state needed)
    batch = trainer._generate_and_score_completions(PROMPTS)
    batch["advantages"] = torch.linspace(-1.0, 1.0, batch["advantages"].numel(), dtype=torch.float64)
    params = {"head": trainer.model.lm_head.weight, "backbone": trainer.model.model.layers[1].mlp.down_proj.weight}
    loss = trainer.compute_loss(trainer.model, batch)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    eps = 1e-4  # TRL's loss path accumulates in float32 even for a float64 model: smaller steps are noise
    for name, p in params.items():
        flat = grads[name].flatten()
        for index in flat.abs().topk(3).indices.tolist():  # the largest entries: well above the noise floor
            with torch.no_grad():
                original = p.view(-1)[index].item()
                p.view(-1)[index] = original + eps
                plus = trainer.compute_loss(trainer.model, batch).item()
                p.view(-1)[index] = original - eps
                minus = trainer.compute_loss(trainer.model, batch).item()
                p.view(-1)[index] = original
            assert (plus - minus) / (2 * eps) == pytest.approx(flat[index].item(), rel=2e-3, abs=1e-7), (name, index)
    off = _float64_trainer(tmp_path, make_args, "off")
    off.model.eval()
    off_loss = off.compute_loss(off.model, {**batch, "old_per_token_logps": batch["old_per_token_logps"]})
    off_grad = torch.autograd.grad(off_loss, [off.model.lm_head.weight])[0]
    assert (off_grad - grads["head"]).abs().max() > 1e-2 * grads["head"].abs().max()


@pytest.mark.parametrize("mode", [dict(), dict(rollout_corr_preset="bypass_ppo_clip")], ids=["decoupled", "bypass"])
@pytest.mark.parametrize("matching", ["recompute", "replay"])
def test_training_with_support_matching(mode, matching, llama_dir, tmp_path, make_trainer, step_logs):
    trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching=matching, top_p=0.8, max_steps=2,
                           rollout_is="token", rollout_is_threshold=2.0, **mode)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(r["loss"]) for r in logs)
    for r in logs:
        assert -1.0 < r[f"{SUPPORT}log_mass_mean"] < 0.0 and r[f"{SUPPORT}size_mean"] >= 1.0
        # decoupled: pi_old / mu; bypass: pi_theta / mu, on-policy here (one micro-batch per generation batch)
        ratio = r["rollout_corr/direct_ratio_mean"] if mode else r["rollout_corr/engine_ratio_mean"]
        assert ratio == pytest.approx(1.0, abs=1e-5)


def test_off_with_truncation_warns_once_with_the_measured_kept_mass(llama_dir, tmp_path, make_trainer, step_logs,
                                                                    caplog):
    trainer = make_trainer(llama_dir, tmp_path, top_p=0.8, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.trainer"):
        trainer.train()
    logs = step_logs(trainer)
    measured = logs[0][f"{SUPPORT}log_mass_mean"]
    assert measured < -1e-3 and f"{SUPPORT}log_mass_mean" not in logs[1]  # measured once, at the first batch
    warnings = [r.getMessage() for r in caplog.records if "Measured mean log kept mass" in r.getMessage()]
    assert len(warnings) == 1 and f"{measured:.4f}" in warnings[0] and "top_p=0.8" in warnings[0]


def test_matching_off_changes_nothing(llama_dir, tmp_path, make_args):
    """Off (the default), with truncation on: the losses are plain TRL's (GRPOTrainer with the same config)."""
    args = dict(top_p=0.8, max_steps=2, rollout_corr_preset="disabled")
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    runs = []
    for cls in (RolloutCorrGRPOTrainer, GRPOTrainer):
        trainer = cls(model=llama_dir, reward_funcs=reward_len, args=make_args(tmp_path / cls.__name__, **args),
                      train_dataset=prompt_dataset(8))
        trainer.train()
        runs.append([r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("matching", ["recompute", "replay"])
def test_support_matching_with_routing_replay(matching, tmp_path, make_trainer, step_logs):
    """With routing replay (issue 14) TRL's pi_old forward is skipped and pi_old is recomputed with the routes
    replayed: that forward is the one scored over the support. Float32 on both sides: routes equal the recorded
    ones, and pi_old / mu is 1 to 1e-5 at top_p 0.8 (without matching it would sit at the kept mass)."""
    moe_dir = make_tiny_model_dir(str(tmp_path / "moe"), "qwen3_moe", seed=0)
    trainer = make_trainer(moe_dir, tmp_path / "run", routing_replay="r3", rollout_support_matching=matching,
                           top_p=0.8, rollout_corr_preset="decoupled_token_is", max_steps=2)
    trainer.train()
    logs = step_logs(trainer)
    # TRL's skipped; pi_old is read from the first loss forward (replayed, support-scored), once per batch
    assert trainer.rollout_corr_forward_counts["old_from_loss"] == 2
    assert trainer.rollout_corr_forward_counts["old_log_probs"] == 0
    for log in logs:
        assert log["rollout_corr/routing_mismatch_fraction"] == 0.0
        assert log["rollout_corr/engine_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        for key in ("p01", "max"):
            assert log[f"rollout_corr/engine_ratio_{key}"] == pytest.approx(1.0, abs=1e-5)
        assert -1.0 < log[f"{SUPPORT}log_mass_mean"] < -1e-3 and log[f"{SUPPORT}miss_fraction"] == 0.0


@pytest.mark.parametrize("reuse", [dict(num_iterations=2), dict(steps_per_generation=2)], ids=str)
def test_decoupled_matching_where_pi_theta_can_leave_pi_olds_support_is_refused(reuse, tmp_path, make_args):
    """Decoupled matching scores pi_theta over its own recomputed support; where an optimizer step separates the pi_old
    and loss forwards, tokens outside pi_theta's support would be trained on uncounted: refused at config time
    (bypass makes its misses invalid and is allowed)."""
    with pytest.raises(ValueError, match=r"decoupled mode scores pi_theta.*bypass_mode=True"):
        make_args(tmp_path, rollout_support_matching="recompute", top_p=0.8,
                  rollout_corr_preset="decoupled_token_is", **reuse)
    make_args(tmp_path, rollout_support_matching="recompute", top_p=0.8, rollout_corr_preset="bypass_ppo_clip",
              **reuse)
    make_args(tmp_path, rollout_support_matching="recompute", top_p=0.8, rollout_corr_preset="decoupled_token_is")


@pytest.mark.parametrize("preset", ["bypass_ppo_clip", "decoupled_token_is"])
def test_analyze_reproduces_a_support_matched_run(llama_dir, tmp_path, monkeypatch, preset):
    """Issue 22: analyze refused support-matched dumps (the missed tokens were not recorded). The records now hold
    the support the trainer scored with (log S, |K|, misses; decoupled: the pi_old forward's, bypass: each loss
    forward's), so analyze reproduces every logged rollout_corr/* value, the support_* ones included, at its default
    tolerance (1e-5). A top-p 0.8 engine 2 steps stale samples tokens outside the trainer's support: misses > 0."""
    from conftest import _make_args
    from stale_rollout import StaleRollout
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = _make_args(tmp_path, rollout_corr_preset=preset, top_p=0.8, max_steps=3, learning_rate=3e-2,
                      rollout_support_matching="recompute", rollout_dump_dir=str(tmp_path / "dump"))
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8),
                                     rollout_func=StaleRollout(sync_interval=3, top_p=0.8))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    check, analyses, _ = analyse_dump(open_dump(tmp_path / "dump"), [])
    assert check.ok and not check.skipped, check.failures[:3]
    from trl_rollout_corr.support import SUPPORT_METRICS

    support_keys = {f"rollout_corr/{k}" for k in SUPPORT_METRICS}
    assert support_keys <= set(logs[0]) and not support_keys & check.not_recomputed
    assert max(log["rollout_corr/support_miss_fraction"] for log in logs) > 0  # misses happened, and were recorded
    for log in logs:
        ours = analyses[0].per_window[log["step"]].metrics()
        for key in sorted(support_keys) + ["rollout_corr/invalid_token_fraction"]:
            assert ours[key] == pytest.approx(log[key], abs=1e-5 * max(1.0, abs(log[key]))), (log["step"], key)
    assert check.compared >= 20 * len(logs)


def test_matched_forwards_skip_trls_lm_head_pass(llama_dir, tmp_path, make_trainer, step_logs):
    """Matching on: every policy forward is scored by the support scorer alone (TRL's fused head, whose log-probs
    would be replaced, never runs); the logged entropy is the scorer's full-vocabulary entropy."""
    from unittest import mock

    import trl.trainer.utils as trl_utils

    calls = []
    original = trl_utils._ChunkedLogProbFunction.apply

    def spy(hidden, *args):
        calls.append(hidden.size(0))
        return original(hidden, *args)

    trainer = make_trainer(llama_dir, tmp_path, rollout_support_matching="recompute", top_p=0.8,
                           rollout_corr_preset="decoupled_token_is", max_steps=2)
    with mock.patch.object(trl_utils._ChunkedLogProbFunction, "apply", spy):
        trainer.train()
    assert calls == []
    for log in step_logs(trainer):
        assert 0.0 < log["entropy"] < math.log(len(trainer.processing_class))
