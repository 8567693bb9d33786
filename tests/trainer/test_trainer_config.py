"""RolloutCorrGRPOConfig: presets and flat fields, validation, CLI/YAML/checkpoint round trips, and how the
trainer takes its args."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle

import pytest
import torch
from trl import GRPOConfig

from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.config import CORRECTION_FIELDS, RolloutCorrectionArguments
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer


# ---------------------------------------------------------------------------------------------- config, CLI, YAML
def test_config_preset_overrides_and_validation(tmp_path, make_args):
    args = make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.005")
    cfg = args.rollout_correction()
    assert (cfg.rollout_is, cfg.rollout_rs, cfg.rs_specs[0].upper) == ("token", "seq_mean_k3", 0.005)
    assert args.rollout_is_threshold == "2.0" and args.vllm_importance_sampling_correction is False
    no_is = make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_is="none")
    # a preset's IS switched off stays explicitly "none", so re-parsing the fields (YAML, checkpoint) keeps it off
    assert (no_is.rollout_is == "none" and not no_is.rollout_correction().is_enabled
            and no_is.rollout_rs == "seq_mean_k3")
    names = ("rollout_corr_preset", "rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")
    fields = {k: getattr(no_is, k) for k in names}
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
    with pytest.raises(ValueError, match="vespo"):  # (issue 9: only with a correction configured; TRL's otherwise)
        make_args(tmp_path, rollout_is="token", loss_type="vespo")
    with pytest.raises(ValueError, match="preset"):
        make_args(tmp_path, rollout_corr_preset="nope")
    with pytest.raises(ValueError):
        make_args(tmp_path, rollout_is="token", rollout_is_threshold="2_1")


def test_cli_flags_and_yaml_round_trip(tmp_path, make_args):
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
                    "rollout_rs: seq_mean_k3\nrollout_rs_threshold: 0.01\nbypass_mode: true\n"
                    "bypass_loss_type: reinforce\n")
    (hand,) = parser.parse_args_and_config(["--config", str(path)])
    cfg = hand.rollout_correction()
    assert cfg.is_bounds.lower == 0.5 and cfg.rs_specs[0].upper == 0.01 and cfg.bypass_loss_type == "reinforce"


def test_checkpoint_save_and_resume(llama_dir, tmp_path, make_trainer, step_logs):
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


def test_plain_grpo_config_is_refused(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="RolloutCorrGRPOConfig"):
        RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                               args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]))



# ---------------------------------------------------------------------------------------------- config layout
def test_trainer_config_inherits_the_flat_correction_fields(tmp_path, make_args):
    assert issubclass(RolloutCorrGRPOConfig, RolloutCorrectionArguments)
    assert issubclass(RolloutCorrGRPOConfig, GRPOConfig)
    names = [f.name for f in dataclasses.fields(RolloutCorrGRPOConfig)]
    assert names[0] == "output_dir"  # TrainingArguments' fields keep their positions
    assert RolloutCorrGRPOConfig(str(tmp_path), use_cpu=True, report_to=[]).output_dir == str(tmp_path)
    assert [n for n in names if n in CORRECTION_FIELDS] == list(CORRECTION_FIELDS)
    args = make_args(tmp_path, rollout_corr_preset="bypass_pg_is", rollout_is_threshold="3")
    assert args.rollout_correction() == args.resolve() and args.rollout_correction().is_bounds.upper == 3.0
    # TRL/Trainer deep-copy and pickle the args: the frozen core config is rebuilt from the flat fields each time
    for again in (copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert again.rollout_correction() == args.rollout_correction()
        assert {k: getattr(again, k) for k in CORRECTION_FIELDS} == {k: getattr(args, k) for k in CORRECTION_FIELDS}


def test_rollout_dump_every_without_rollout_dump_dir_is_refused(tmp_path, make_args):
    """rollout_dump_every thins the records; without rollout_dump_dir none are written, so the setting would be
    silently ignored: refused, naming both fixes (accepted before)."""
    with pytest.raises(ValueError, match=r"rollout_dump_every=5 .* rollout_dump_dir is unset .* set rollout_dump_dir, "
                                         r"or unset rollout_dump_every"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", rollout_dump_every=5)
    assert make_args(tmp_path, rollout_dump_every=5, rollout_dump_dir=str(tmp_path / "d")).rollout_dump_every == 5
    assert make_args(tmp_path).rollout_dump_every == 1  # the default, without a dump


def test_rs_keep_rejected_in_baseline_where_no_row_can_leave_the_baseline_is_refused(tmp_path, make_args):
    """True without a correction, or in bypass mode without max_policy_lag, would be ignored (no row ever leaves its
    group's baseline there): refused, naming the fix. Where a row can leave it, accepted (the previous bypass
    warning said "no effect" also with max_policy_lag, whose stale rows it does keep in the baseline)."""
    with pytest.raises(ValueError, match=r"rs_keep_rejected_in_baseline=True .* no correction is configured .* "
                                         r"configure one \(e\.g\. rollout_rs .* or unset "
                                         r"rs_keep_rejected_in_baseline"):
        make_args(tmp_path, rs_keep_rejected_in_baseline=True)
    with pytest.raises(ValueError, match=r"no effect in bypass mode without max_policy_lag: RS runs in the loss.* "
                                         r"Unset rs_keep_rejected_in_baseline, set max_policy_lag, or use decoupled "
                                         r"mode \(bypass_mode=False\)"):
        make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip_k3_rs", rs_keep_rejected_in_baseline=True)
    accepted = [dict(rollout_corr_preset="bypass_ppo_clip_k3_rs", max_policy_lag=1),  # the stale rows stay in
                dict(rollout_corr_preset="decoupled_k3_rs_token_tis"),  # RS-rejected rows stay in
                dict(rollout_corr_preset="decoupled_token_is")]  # rows left with only invalid tokens stay in
    for fields in accepted:
        assert make_args(tmp_path, rs_keep_rejected_in_baseline=True, **fields).rs_keep_rejected_in_baseline
    make_args(tmp_path, rollout_corr_preset="bypass_ppo_clip_k3_rs")  # the default (False) everywhere
    make_args(tmp_path)


def test_rollout_generate_dtype_is_validated(tmp_path, make_args):
    assert make_args(tmp_path, rollout_generate_dtype="bfloat16").rollout_generate_dtype == "bfloat16"
    with pytest.raises(ValueError, match="rollout_generate_dtype must be one of"):
        make_args(tmp_path, rollout_generate_dtype="bf16")
    # issue 44, item 6: TRL's continuous batching never runs our generate (it was accepted and silently ignored)
    assert make_args(tmp_path, use_transformers_continuous_batching=True).rollout_generate_dtype is None
    with pytest.raises(ValueError, match=r"rollout_generate_dtype applies to the plain transformers.generate path "
                                         r"only; with use_transformers_continuous_batching=True"):
        make_args(tmp_path, rollout_generate_dtype="bfloat16", use_transformers_continuous_batching=True)


def test_trainer_takes_args_by_position_or_keyword(llama_dir, tmp_path, make_args):
    args = make_args(tmp_path, rollout_corr_preset="decoupled_token_is")
    positional = RolloutCorrGRPOTrainer(llama_dir, reward_len, args, prompt_dataset(8))
    assert positional.rollout_correction == args.rollout_correction()
    with pytest.raises(TypeError, match="RolloutCorrGRPOConfig"):
        RolloutCorrGRPOTrainer(llama_dir, reward_len, GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    # (issue 9) args omitted: TRL's default config, with this trainer's config class
    # (tests/trainer/test_trainer_drop_in.py)
    with pytest.raises(TypeError):  # not a GRPOTrainer argument at all: refused by the signature, as GRPOTrainer does
        RolloutCorrGRPOTrainer(model=llama_dir, args=args, not_an_argument=1)


def test_rollout_generate_dtype_with_a_rollout_func_is_refused(llama_dir, tmp_path, make_args, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = make_args(tmp_path, rollout_corr_preset="decoupled_token_is", rollout_generate_dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout_func"):
        RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset(8),
                               rollout_func=lambda prompts, trainer: {})


def test_settings_of_trls_own_vllm_is_are_refused_with_a_correction(tmp_path, make_args):
    """They configure TRL's vLLM IS, which is off while a correction is on: silently inert before issue 9."""
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode, vllm_importance_sampling_clip_max configure"):
        make_args(tmp_path, rollout_is="token", vllm_importance_sampling_mode="token_truncate",
                  vllm_importance_sampling_clip_max=2.0)
    args = make_args(tmp_path, vllm_importance_sampling_mode="token_truncate")  # no correction: TRL's, as given
    assert args.vllm_importance_sampling_mode == "token_truncate" and args.vllm_importance_sampling_correction


def test_is_weights_with_bypass_ppo_clip_warn_that_they_are_metrics_only(tmp_path, make_args, caplog):
    """Bypass PPO clip multiplies no IS weight into its loss (docs/reference/configuration.md): rollout_is there is
    accepted (its
    metrics are logged) with a start-up warning naming the fix; batch normalisation adds its cost to the warning."""
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.modes.bypass"):
        make_args(tmp_path, bypass_mode=True, bypass_loss_type="ppo_clip", rollout_is="token")
    said = [r.getMessage() for r in caplog.records if "multiplied into no loss" in r.getMessage()]
    assert len(said) == 1 and "bypass_loss_type='reinforce'" in said[0] and "extra no-grad forward" not in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.modes.bypass"):
        make_args(tmp_path, bypass_mode=True, bypass_loss_type="ppo_clip", rollout_is="sequence",
                  rollout_is_batch_normalize=True)
    said = [r.getMessage() for r in caplog.records if "multiplied into no loss" in r.getMessage()]
    assert len(said) == 1 and "extra no-grad forward" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.modes.bypass"):
        make_args(tmp_path, bypass_mode=True, bypass_loss_type="reinforce", rollout_is="sequence")
        make_args(tmp_path, bypass_mode=True, bypass_loss_type="ppo_clip", rollout_rs="seq_mean_k3",
                  rollout_rs_threshold=0.01)
    assert not [r for r in caplog.records if "multiplied into no loss" in r.getMessage()]
