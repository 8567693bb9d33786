"""Unit tests of the recipe's helpers (recipes/grpo_recipe_utils.py, recipes/print_run_summary.py) and of every
recipe config file.

No vLLM, no real model: configs are parsed with TrlParser exactly as the recipe does; the reasoning-gym tests skip
when reasoning-gym is not installed (it comes with the vLLM setup, mk/demo.mk).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from script_module import load_script

pytest.importorskip("trl")

import grpo_recipe_utils as ru  # noqa: E402  (recipes/ is on pytest's pythonpath)
import print_run_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


def _recipe():
    return load_script("recipes/grpo_rollout_corr.py", "grpo_rollout_corr_recipe_t")


def _parse(config: Path, *extra: str):
    from trl import ModelConfig, TrlParser

    recipe = _recipe()
    parser = TrlParser((recipe.ScriptArguments, recipe.RolloutCorrGRPOConfig, ModelConfig))
    return parser.parse_args_and_config(args=["--config", str(config), *extra])


def test_last_number():
    assert ru.last_number("The answer is 12.") == "12"
    assert ru.last_number("41 - 52 = -11") == "-11"
    assert ru.last_number("1,234 and then 5.5") == "5.5"
    assert ru.last_number("1,234") == "1234"
    assert ru.last_number("no digits") is None
    assert ru.last_number("") is None


def test_seed_ranges_must_not_overlap():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ValueError, match="overlap"):
        ru.make_task_splits("chain_sum", {}, 2000, 42, 128, 1234)
    train, held_out = ru.make_task_splits("chain_sum", {"min_digits": 1, "max_digits": 2}, 50, 42, 20, 92)
    assert train.size == 50 and held_out.seed == 92


def test_reasoning_gym_reward_exact_match_only():
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("datasets")
    task = ru.ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 8, 42)
    ds = task.to_dataset()
    assert ds.column_names == ["prompt", "answer", "rg_index"]
    assert ds[0]["prompt"][0]["role"] == "user" and ds[0]["prompt"][0]["content"].endswith(ru.DEFAULT_INSTRUCTION)
    reward = task.reward_func()
    answers = [task.rg[i]["answer"] for i in range(8)]
    right = [[{"role": "assistant", "content": f"The result is {a}."}] for a in answers]
    wrong = [[{"role": "assistant", "content": f"The result is {int(a) + 1}."}] for a in answers]
    partial = [[{"role": "assistant", "content": f"{a}5"}] for a in answers]  # reasoning-gym gives partial credit
    assert reward(right, list(range(8))) == [1.0] * 8
    assert reward(wrong, list(range(8))) == [0.0] * 8
    assert reward(partial, list(range(8))) == [0.0] * 8
    assert reward(["no number"], [0]) == [0.0]
    assert reward([answers[3]], [3]) == [1.0]  # plain-text completions too
    # same seed, same problems (deterministic)
    again = ru.ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 8, 42)
    assert [again.rg[i]["question"] for i in range(8)] == [task.rg[i]["question"] for i in range(8)]


def test_eval_result_stderr_and_paired_difference():
    r = ru.EvalResult(accuracy=0.25, correct=32, total=128, mean_completion_tokens=10.0, seconds=1.0)
    assert r.stderr == pytest.approx((0.25 * 0.75 / 128) ** 0.5)
    d = ru.paired_difference([0, 0, 1, 1], [1, 0, 1, 1])
    assert d["mean"] == 0.25 and d["n"] == 4 and d["stderr"] > 0


def test_jsonl_callback_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    cb = ru.make_jsonl_callback(tmp_path / "log.jsonl", extra={"rollout_dtype": "bfloat16"})
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    for step in range(1, 4):
        state.global_step = step
        cb.on_log(None, state, None, logs={"loss": 0.1 * step, "reward": 0.2 * step, "rollout_corr/kl": 1e-3 * step,
                                            "rollout_corr/rollout_is_eff_sample_size": 0.99,
                                            "rollout_corr/rollout_rs_masked_fraction": 0.0})
    cb.on_log(None, state, None, logs={"train_runtime": 12.0})
    records = ru.read_jsonl(tmp_path / "log.jsonl")
    assert records[0] == {"run_config": {"rollout_dtype": "bfloat16"}}
    assert [r["step"] for r in records[1:4]] == [1, 2, 3] and records[2]["reward"] == pytest.approx(0.4)
    written = ru.plot_metrics(tmp_path / "log.jsonl", tmp_path)
    names = {p.name for p in written}
    assert {"reward.png", "rollout_corr_kl.png", "rollout_corr_rollout_is_eff_sample_size.png",
            "rollout_corr_rollout_rs_masked_fraction.png", "metrics.png"} == names
    assert all(p.stat().st_size > 1000 for p in written)


def test_model_card_section_records_correction_and_engine():
    text = ru.model_card_section(
        {"rollout_is": "token", "rollout_rs": "seq_mean_k3"},
        {"rollout_engine": "vllm_cpu", "rollout_dtype": "bfloat16", "rollout_logprobs_mode": "processed_logprobs"},
        {"task": "reasoning-gym chain_sum"},
        {"before": {"accuracy": 0.1, "stderr": 0.02, "correct": 13, "total": 128},
         "after": {"accuracy": 0.3, "stderr": 0.04, "correct": 38, "total": 128}},
    )
    for needle in ("`rollout_is` | `token`", "`rollout_dtype` | `bfloat16`", "processed_logprobs", "13 / 128",
                   "38 / 128"):
        assert needle in text


def test_pick_threads():
    assert ru.pick_threads(3) == 3
    assert ru.pick_threads(0) >= 1


def test_paired_difference_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="same items"):
        ru.paired_difference([0, 1], [1])
    with pytest.raises(ValueError, match="non-empty"):
        ru.paired_difference([], [])


def test_engine_record_is_explicit():
    assert ru.engine_record("vllm_cpu", "bfloat16", "unused")["rollout_logprobs_mode"] == "processed_logprobs"
    assert ru.engine_record("transformers", "float32", "unused", bf16=True)["rollout_dtype"] == "bfloat16 (autocast)"
    with pytest.raises(ValueError, match="vllm_cpu, trl_vllm or transformers"):
        ru.engine_record("sglang", "bfloat16", "unused")


def test_rollout_correction_record_after_preset_expansion():
    _, training_args, _ = _parse(CONFIGS[0], "--output_dir", "/tmp/unused")
    record = ru.rollout_correction_record(training_args)
    correction = training_args.rollout_correction()
    for key in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode"):
        assert record[key] == getattr(correction, key), key
    assert "rollout_corr_preset" in record and "rs_keep_rejected_in_baseline" in record


def test_print_run_summary(tmp_path, capsys):
    before = {"accuracy": 0.25, "correct": 32, "total": 128}
    after = {"accuracy": 0.5, "correct": 64, "total": 128}
    (tmp_path / "results.json").write_text(json.dumps(
        {"before": before, "after": after, "improvement": {"mean": 0.25, "stderr": 0.04, "n": 128}}))
    assert print_run_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "before 0.250 (32/128), after 0.500 (64/128), paired difference +0.250" in out
    assert f"outputs: {tmp_path}/" in out
    assert print_run_summary.summary_lines({}, "x")[0].endswith("rollout engine other than vllm_cpu)")
    assert print_run_summary.main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_recipe_config_parses(config):
    """Every YAML is a valid (ScriptArguments, RolloutCorrGRPOConfig, ModelConfig) for the recipe's TrlParser."""
    import yaml

    raw = yaml.safe_load(config.read_text())
    # GPU configs train in bf16, which transformers refuses on a CPU-only machine at parse time: parse with bf16 off.
    extra = ["--bf16", "false"] if config.name.startswith("gpu_") else []
    script_args, training_args, model_args = _parse(config, "--output_dir", "/tmp/unused", *extra)
    assert script_args.rollout_engine in ("vllm_cpu", "trl_vllm")
    assert script_args.rollout_dtype in ("bfloat16", "float32")
    assert script_args.eval_size == 0 or script_args.eval_seed >= script_args.train_seed + script_args.train_size
    json.loads(script_args.task_config)
    correction = training_args.rollout_correction()
    if config.name.startswith("cpu_"):
        assert model_args.model_name_or_path == "models/SmolLM2-135M-Instruct" and model_args.dtype == "float32"
        assert training_args.bf16 is False and script_args.rollout_engine == "vllm_cpu"
        assert script_args.eval_size >= 128
    else:
        assert training_args.use_vllm and training_args.vllm_mode == "colocate" and raw["bf16"] is True
        assert script_args.rollout_engine == "trl_vllm" and model_args.model_name_or_path == "Qwen/Qwen2.5-7B"
    expected = {
        "cpu_smollm2_decoupled.yaml": dict(bypass_mode=False, rollout_is="token", rollout_rs="seq_mean_k3"),
        "cpu_smollm2_bypass.yaml": dict(bypass_mode=True, bypass_loss_type="ppo_clip", rollout_rs="seq_mean_k3"),
        "cpu_smollm2_no_correction.yaml": dict(bypass_mode=False, rollout_is=None, rollout_rs=None),
        "gpu_qwen2.5-7b_decoupled_token_is.yaml": dict(bypass_mode=False, rollout_is="token", rollout_rs=None),
        "gpu_qwen2.5-7b_decoupled_multi_rs.yaml": dict(bypass_mode=False, rollout_is="token",
                                                        rollout_rs="token_k1,seq_mean_k3,seq_max_k2"),
        "gpu_qwen2.5-7b_bypass_ppo_clip.yaml": dict(bypass_mode=True, bypass_loss_type="ppo_clip"),
        "gpu_qwen2.5-7b_bypass_pg_seq_is_bn.yaml": dict(bypass_mode=True, bypass_loss_type="reinforce",
                                                         rollout_is="sequence", rollout_is_batch_normalize=True),
    }[config.name]
    for key, value in expected.items():
        assert getattr(correction, key) == value, (key, getattr(correction, key))


def test_cpu_counterparts_differ_only_in_the_correction():
    """Same data, seed and optimisation in the three CPU configs: only correction fields and output_dir differ."""
    import yaml

    loaded = {c.name: yaml.safe_load(c.read_text()) for c in CONFIGS if c.name.startswith("cpu_")}
    assert set(loaded) == {"cpu_smollm2_decoupled.yaml", "cpu_smollm2_bypass.yaml", "cpu_smollm2_no_correction.yaml"}
    correction_keys = {"rollout_corr_preset", "rollout_is", "rollout_is_threshold", "output_dir"}
    base = {k: v for k, v in loaded["cpu_smollm2_decoupled.yaml"].items() if k not in correction_keys}
    for name, cfg in loaded.items():
        assert {k: v for k, v in cfg.items() if k not in correction_keys} == base, name


@pytest.mark.parametrize("config", ACCELERATE, ids=[c.name for c in ACCELERATE])
def test_accelerate_configs_are_valid(config):
    """accelerate's own loader accepts every launch config."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(config))
    assert cfg.num_processes >= 1
    if "deepspeed" in config.name:
        assert cfg.distributed_type.value == "DEEPSPEED"
        stage = cfg.deepspeed_config.get("zero_stage")
        if "deepspeed_config_file" in cfg.deepspeed_config:  # the stage and the rest in DeepSpeed's own JSON
            import json

            ds = json.loads((ROOT / cfg.deepspeed_config["deepspeed_config_file"]).read_text())
            stage = ds["zero_optimization"]["stage"]
        assert stage in (2, 3)


def test_rollout_seed_is_refused_where_it_would_be_ignored(tmp_path):
    """--rollout_seed seeds only the server the recipe starts: with the in-process engine two runs at --rollout_seed
    0 and 2 sampled identically (measured: `make demo` --seed 42, per-step logs equal, 64/128 both), since the
    Trainer re-seeds torch's global RNG with --seed after the engine starts. So it is refused there, naming --seed."""
    config = ROOT / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"
    script_args, training_args, model_args = _parse(config, "--rollout_seed", "2", "--output_dir", str(tmp_path))
    with pytest.raises(ValueError, match="--rollout_seed 2 would be ignored: .* change --seed instead"):
        _recipe().main(script_args, training_args, model_args)


def test_vllm_server_start_needs_the_server_path_and_the_server_dtype_is_checked(tmp_path):
    """--vllm_server_start is refused outside --rollout_engine trl_vllm --use_vllm --vllm_mode server (before anything
    starts); in server mode the engine record takes the server's --dtype, and a server serving another dtype than
    --rollout_dtype is refused by name."""
    config = ROOT / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"
    script_args, training_args, model_args = _parse(config, "--vllm_server_start", "true", "--output_dir",
                                                    str(tmp_path))
    with pytest.raises(ValueError, match="--rollout_engine trl_vllm --use_vllm --vllm_mode server"):
        _recipe().main(script_args, training_args, model_args)
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32", "model_type": "llama"}))
    record = ru.engine_record("trl_vllm", "bfloat16", str(tmp_path), vllm_mode="server")
    assert record["rollout_engine"] == "trl_vllm_server" and record["rollout_dtype"] == "bfloat16"
    # colocate: the trainer hands rollout_dtype to TRL's engine (rollout_vllm_dtype), whatever the checkpoint's dtype
    record = ru.engine_record("trl_vllm", "bfloat16", str(tmp_path), vllm_mode="colocate")
    assert record["rollout_engine"] == "trl_vllm_colocate" and record["rollout_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="vllm_mode must be 'colocate' or 'server'"):
        ru.engine_record("trl_vllm", "bfloat16", str(tmp_path), vllm_mode="remote")

    class Client:
        base_url = "http://127.0.0.1:1"

        def get_server_info(self):
            return {"model_config": {"dtype": "torch.float32"}}

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(vllm_client=Client()))
    ru.check_server_dtype(trainer, "float32")
    with pytest.raises(ValueError, match="serves float32, but rollout_dtype='bfloat16'"):
        ru.check_server_dtype(trainer, "bfloat16")
