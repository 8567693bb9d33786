"""The drop-in promise (issue 9): with no correction configured RolloutCorrGRPOTrainer is TRL's GRPOTrainer (same
losses, same accepted options, same flags, TRL's default config), the rollout_corr/* diagnostics on the side; with a
correction, what it cannot serve is refused when the config is built, naming the option."""

from __future__ import annotations

import warnings
from unittest.mock import patch

import pytest
import torch
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer


def _train_both(model_dir, tmp_path, make_args, max_steps=3, ours_only=None, **overrides):
    """Per-step (loss, grad_norm) of plain TRL and of the subclass on the same config and seed (``ours_only``: our
    own fields, e.g. a preset)."""
    out = {}
    for name, trainer_cls, config_cls in (("trl", GRPOTrainer, GRPOConfig), ("ours", RolloutCorrGRPOTrainer, None)):
        own = (ours_only or {}) if name == "ours" else {}
        args = make_args(tmp_path / name, config_cls=config_cls, max_steps=max_steps, **own, **overrides)
        trainer = trainer_cls(model=model_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset(8))
        trainer.train()
        out[name] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        out[name + "_trainer"] = trainer
    return out


# ---------------------------------------------------------------------------------------------- TRL's semantics kept
def test_disabled_preset_with_opsm_gives_plain_trl_losses(llama_dir, tmp_path, make_args):
    """The issue's repro: top_p 0.8, TRL's off_policy_mask_threshold 0.05, the ``disabled`` (diagnostics) preset.

    Before the fix the subclass put its behaviour log-probs into TRL's ``sampling_per_token_logps`` on the plain
    generate path, so OPSM measured its KL against mu instead of pi_old and dropped rows TRL keeps (measured: step
    losses -0.360 / -0.208 / -0.224 against TRL's 8.9e-8 / 0.730 / 0.323)."""
    runs = _train_both(llama_dir, tmp_path, make_args, ours_only=dict(rollout_corr_preset="disabled"), top_p=0.8,
                       off_policy_mask_threshold=0.05)
    assert runs["ours"] == runs["trl"]  # bit for bit
    logs = [h for h in runs["ours_trainer"].state.log_history if "loss" in h]
    # the diagnostics still see the truncation mismatch (pi_old vs mu): top_p lifts log mu above log pi_old
    assert all(h["rollout_corr/kl"] > 1e-2 for h in logs)


def test_vespo_and_beam_sampling_without_a_correction_train_as_trl(llama_dir, tmp_path, make_args):
    """Both were refused even without a correction (beam sampling only at the first step, by the generate capture);
    now TRL's own behaviour, and refused at config time only with a correction."""
    for name, overrides in (("vespo", dict(loss_type="vespo")), ("beams", dict(generation_kwargs={"num_beams": 2}))):
        runs = _train_both(llama_dir, tmp_path / name, make_args, max_steps=2, **overrides)
        assert runs["ours"] == runs["trl"]
        logs = [h for h in runs["ours_trainer"].state.log_history if "loss" in h]
        # beam sampling has no sampling distribution: no mu, so no diagnostics (TRL's run, nothing else)
        assert all(("rollout_corr/kl" in h) == (name == "vespo") for h in logs)
    with pytest.raises(ValueError, match="vespo"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", loss_type="vespo")
    with pytest.raises(ValueError, match="generation_kwargs"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="generation_kwargs"):
        make_args(tmp_path, rollout_corr_preset="bypass_pg_is", generation_kwargs={"do_sample": False})


def _fake_generate(tok):
    """A ``model.generate`` replacement as TRL's own tool/environment tests use: fixed completions, no sampling."""
    completion = tok("aab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def fake(input_ids, **kwargs):
        rows = torch.tensor([completion] * input_ids.size(0), device=input_ids.device)
        return torch.cat([input_ids, rows], dim=1)

    return fake


def test_replaced_generate_is_trls_without_a_correction_and_named_with_one(llama_dir, tmp_path, make_args,
                                                                            make_trainer, caplog):
    """Before the fix the capture raised "Expected one logits-processor list per generate call, saw 0" in both
    cases (a RuntimeError at the first step)."""
    logs = {}
    for name, trainer_cls, config_cls in (("trl", GRPOTrainer, GRPOConfig), ("ours", RolloutCorrGRPOTrainer, None)):
        trainer = trainer_cls(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                              args=make_args(tmp_path / name, config_cls=config_cls, max_steps=2))
        with patch.object(trainer.model, "generate", side_effect=_fake_generate(trainer.processing_class)):
            trainer.train()
        logs[name] = [h for h in trainer.state.log_history if "loss" in h]
    assert [(h["loss"], h["grad_norm"]) for h in logs["ours"]] == [(h["loss"], h["grad_norm"]) for h in logs["trl"]]
    assert not any(k.startswith("rollout_corr/kl") for h in logs["ours"] for k in h)
    assert "no rollout_corr/* diagnostics" in caplog.text and "model.generate has been replaced" in caplog.text

    trainer = make_trainer(llama_dir, tmp_path / "corr", rollout_corr_preset="decoupled_token_is")
    with patch.object(trainer.model, "generate", side_effect=_fake_generate(trainer.processing_class)):
        with pytest.raises(ValueError, match="model.generate has been replaced .* no behaviour log-probs"):
            trainer.train()
    trainer = make_trainer(llama_dir, tmp_path / "corr_class", rollout_corr_preset="bypass_pg_is")
    with patch("transformers.generation.utils.GenerationMixin.generate",
               side_effect=_fake_generate(trainer.processing_class)):
        with pytest.raises(ValueError, match="GenerationMixin.generate has been replaced"):
            trainer.train()


# ---------------------------------------------------------------------------------------------- construction, flags
def test_no_args_builds_trls_default_config(llama_dir, tmp_path, monkeypatch):
    """``RolloutCorrGRPOTrainer(model, reward_funcs, train_dataset=...)``: TRL's default ``GRPOConfig("<model>-GRPO")``
    with this trainer's config class and no correction (before the fix: a TypeError). TRL's default is bf16, which
    transformers refuses on a CPU-only machine without ``use_cpu``; the check is bypassed to compare the configs."""
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    theirs = GRPOTrainer(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8)).args
    with pytest.warns(UserWarning, match="bf16=True .* on CPU"):  # the hidden-mismatch warning
        trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8))
    ours = trainer.args
    assert type(ours) is RolloutCorrGRPOConfig and not trainer.rollout_correction.enabled
    assert ours.output_dir == theirs.output_dir and ours.output_dir.endswith(f"{llama_dir.split('/')[-1]}-GRPO")
    mine, trl_fields = ours.to_dict(), theirs.to_dict()
    assert {k: mine[k] for k in trl_fields if k != "logging_dir"} == {
        k: v for k, v in trl_fields.items() if k != "logging_dir"}


def _options(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_every_trl_flag_is_accepted_and_booleans_are_bare(tmp_path):
    """TRL's parser options are all ours (before the fix ``--no_vllm_importance_sampling_correction`` was missing,
    and the correction's booleans needed a value: ``--bypass_mode`` alone was an error)."""
    theirs, ours = HfArgumentParser(GRPOConfig), HfArgumentParser(RolloutCorrGRPOConfig)
    assert _options(theirs) <= _options(ours)
    base = ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"]
    trl_flags = ["--no_log_multimodal", "--mask_truncated_completions", "--no_use_bias_correction_kl"]
    (trl_args,) = theirs.parse_args_into_dataclasses(base + trl_flags + ["--no_vllm_importance_sampling_correction"])
    (args,) = ours.parse_args_into_dataclasses(base + trl_flags + ["--no_vllm_importance_sampling_correction"])
    for name in ("log_multimodal", "mask_truncated_completions", "use_bias_correction_kl",
                 "vllm_importance_sampling_correction"):
        assert getattr(args, name) == getattr(trl_args, name), name
    assert args.vllm_importance_sampling_correction is False
    (bare,) = ours.parse_args_into_dataclasses(base + ["--vllm_importance_sampling_correction"])
    assert bare.vllm_importance_sampling_correction is True
    (unset,) = ours.parse_args_into_dataclasses(base + ["--rollout_is", "token"])
    assert unset.vllm_importance_sampling_correction is False  # unset: switched off by the correction
    (flags,) = ours.parse_args_into_dataclasses(base + [
        "--rollout_is", "sequence", "--rollout_is_batch_normalize", "--bypass_mode", "--rs_keep_rejected_in_baseline",
        "--bypass_loss_type", "reinforce", "--max_policy_lag", "1"])  # bypass: the flag needs max_policy_lag
    cfg = flags.rollout_correction()
    assert cfg.bypass_mode is True and cfg.rollout_is_batch_normalize is True and flags.rs_keep_rejected_in_baseline
    (explicit,) = ours.parse_args_into_dataclasses(base + ["--rollout_corr_preset", "bypass_pg_is", "--bypass_mode",
                                                           "false", "--rollout_is", "none"])
    assert explicit.rollout_correction().bypass_mode is False and not explicit.rollout_correction().enabled
    with pytest.raises(ValueError, match="corrected twice"):
        ours.parse_args_into_dataclasses(base + ["--rollout_is", "token", "--vllm_importance_sampling_correction"])


def test_trl_default_bf16_on_cpu_warns_that_autocast_hides_the_mismatch(tmp_path, make_args):
    """bf16=True (TRL's default) on CPU: accelerate autocasts every forward, generate's included, so a float32
    trainer meant to be compared with a bf16 engine silently becomes a bf16 one (the issue measured kl -7.8e-8).
    The config now says so and names the fix; float32 stays silent. (Before the fix: no warning.)"""
    with pytest.warns(UserWarning, match="bf16=True .* autocast .* Set bf16=False"):
        make_args(tmp_path, bf16=True)
    with pytest.warns(UserWarning, match="autocast"):
        make_args(tmp_path, bf16=True, rollout_corr_preset="decoupled_token_is")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_args(tmp_path, bf16=False, rollout_corr_preset="decoupled_token_is")


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory):
    """The tiny Llama with attention dropout 0.1 (GPT-2-style configs default to dropout)."""
    from tiny_model import make_tiny_model

    model, tok = make_tiny_model("llama", seed=0)
    model.config.attention_dropout = 0.1
    path = str(tmp_path_factory.mktemp("tiny_llama_dropout"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_no_correction_with_dropout_trains_as_trl(dropout_dir, tmp_path, make_args):
    """The diagnostics' pi_old forward (TRL runs none here) must not consume the random numbers of TRL's dropout
    and sampling: losses and grad norms equal plain TRL's at every step."""
    from trl import GRPOConfig, GRPOTrainer

    from tiny_model import prompt_dataset, reward_len
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    logs = {}
    for name, cls, config_cls in (("trl", GRPOTrainer, GRPOConfig), ("ours", RolloutCorrGRPOTrainer, None)):
        args = make_args(tmp_path / name, config_cls=config_cls, max_steps=3)
        trainer = cls(model=dropout_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset(8))
        trainer.train()
        logs[name] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    assert len(logs["trl"]) == 3 and logs["ours"] == logs["trl"]
    assert trainer.rollout_corr_forward_counts["old_log_probs"] == 3  # the diagnostics did run their own forward
