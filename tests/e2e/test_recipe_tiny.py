"""The recipe (recipes/grpo_rollout_corr.py) end to end on a tiny random model with TRL's transformers.generate
engine: the TRL flags a user passes are honoured (PEFT, resume, evaluation, push_to_hub), and the outputs a person
reads (console line, summary figure, summary.md, model card) are there.

No vLLM and no real model (tiny_model.py, with a chat template for reasoning-gym's chat prompts); needs reasoning-gym
(the ``recipe`` extra, in the test venv). ``--entropy_coef`` gives every step a loss that depends on the weights even
when a random model earns no reward, so "the same loss" is a real comparison.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from script_module import load_script

pytest.importorskip("trl")
pytest.importorskip("reasoning_gym")

import grpo_recipe_utils as ru  # noqa: E402  (recipes/ is on pytest's pythonpath)
from tiny_model import make_tiny_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_chat_llama")), "llama", seed=0, chat_template=True)


def _recipe():
    return load_script("recipes/grpo_rollout_corr.py", "grpo_rollout_corr_recipe_tiny")


def _run(model_dir, out, *extra: str):
    """Parse the arguments with the recipe's own TrlParser and run its ``main``; returns (results, step records)."""
    import torch
    from trl import ModelConfig, TrlParser

    recipe = _recipe()
    parser = TrlParser((recipe.ScriptArguments, recipe.RolloutCorrGRPOConfig, ModelConfig))
    args = [
        "--model_name_or_path", str(model_dir), "--output_dir", str(out), "--dtype", "float32",
        "--task", "chain_sum", "--task_config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        "--train_size", "32", "--train_seed", "42", "--eval_size", "4", "--eval_seed", "1000",
        "--rollout_engine", "transformers", "--rollout_corr_preset", "decoupled_k3_rs_token_tis",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-2", "--entropy_coef", "0.5",
        "--beta", "0.0", "--seed", "0", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
        "--save_strategy", "no", "--torch_threads", "1", "--plots", "false", *extra,
    ]
    script_args, training_args, model_args = parser.parse_args_and_config(args=args)
    threads = torch.get_num_threads()
    try:
        results = recipe.main(script_args, training_args, model_args)
    finally:
        torch.set_num_threads(threads)
    records = ru.read_jsonl(Path(out) / "log.jsonl")
    return results, records


def _steps(records):
    return {r["step"]: r for r in records if "loss" in r}


def test_use_peft_saves_an_adapter(chat_llama_dir, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    results, records = _run(chat_llama_dir, out, "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                            "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "2")
    saved = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved and "model.safetensors" not in saved
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert records[0]["run_config"]["use_peft"] is True
    assert sorted(_steps(records)) == [1, 2]
    from safetensors.torch import load_file

    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors and all("lora_" in name for name in tensors)
    # lora_B starts at 0; two steps at lr 1e-2 moved it
    assert any(t.abs().max() > 0 for name, t in tensors.items() if "lora_B" in name)
    card = (out / "README.md").read_text()
    assert "## Rollout correction (trl-rollout-corr)" in card and "decoupled_k3_rs_token_tis" in card


def test_resume_continues_at_the_saved_step_with_the_same_loss(chat_llama_dir, tmp_path):
    _, full = _run(chat_llama_dir, tmp_path / "full", "--save_strategy", "steps", "--save_steps", "2")
    assert (tmp_path / "full" / "checkpoint-2").is_dir()
    _, resumed = _run(chat_llama_dir, tmp_path / "resumed",
                      "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoint-2"))
    full_steps, resumed_steps = _steps(full), _steps(resumed)
    assert sorted(full_steps) == [1, 2, 3]
    assert sorted(resumed_steps) == [3]  # continues at step 3, does not restart at 1
    a, b = full_steps[3], resumed_steps[3]
    assert a["loss"] != 0.0 and math.isfinite(a["loss"])
    # the same sampled completions, rewards and loss as the uninterrupted run's step 3
    for key in ("loss", "reward", "completions/mean_length", "rollout_corr/num_valid_tokens", "entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_eval_strategy_logs_eval_rollout_corr(chat_llama_dir, tmp_path):
    out = tmp_path / "eval"
    _, records = _run(chat_llama_dir, out, "--eval_strategy", "steps", "--eval_steps", "1", "--max_steps", "2",
                      "--per_device_eval_batch_size", "4")
    evals = [r for r in records if "eval_loss" in r or "eval_reward" in r]
    assert [r["step"] for r in evals] == [1, 2]
    for r in evals:
        assert r["eval_rollout_corr/num_valid_seqs"] == 16  # 4 held-out problems x 4 generations
        assert r["eval_rollout_corr/num_valid_tokens"] > 0 and math.isfinite(r["eval_rollout_corr/kl"])
        assert "eval_rewards/correct_answer/mean" in r


def test_eval_strategy_needs_held_out_problems(chat_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="--eval_size > 0"):
        _run(chat_llama_dir, tmp_path / "x", "--eval_strategy", "steps", "--eval_size", "0")


def test_k_bit_loading_with_the_vllm_cpu_engine_is_refused(chat_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="--load_in_4bit with rollout_engine=vllm_cpu"):
        _run(chat_llama_dir, tmp_path / "x", "--rollout_engine", "vllm_cpu", "--load_in_4bit")
    with pytest.raises(ValueError, match="--use_vllm with rollout_engine=transformers"):
        _run(chat_llama_dir, tmp_path / "x", "--use_vllm")


def test_outputs_a_person_reads(chat_llama_dir, tmp_path, capsys):
    """One console line per step (not TRL's ~110-key dict), the summary figure, summary.md, a card with the right
    name and no dataset link."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo_like"
    results, records = _run(chat_llama_dir, out, "--max_steps", "2", "--plots", "true")
    console = capsys.readouterr().out
    lines = [line for line in console.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"]
    step1 = _steps(records)[1]
    assert f"reward {step1['reward']:.3f}" in lines[0] and f"kl {step1['rollout_corr/kl']:.2e}" in lines[0]
    assert "ESS " in lines[0] and "rejected " in lines[0] and lines[0].endswith(" s")
    assert "'rollout_corr/len_0_64/kl'" not in console  # the full record is in log.jsonl, not on the console
    assert "rollout_corr/len_0_64/kl" in step1
    assert (out / "metrics.png").stat().st_size > 10_000
    assert not (out / "reward.png").exists()  # one summary figure, not one file per metric
    summary = (out / "summary.md").read_text()
    assert "| step | reward |" in summary and f"| 2 | {_steps(records)[2]['reward']:.4g} |" in summary
    assert "torch_threads | `1`" in summary
    card = (out / "README.md").read_text()
    assert "# Model Card for demo_like" in card and "None" not in card.split("\n## ")[0]
    assert "huggingface.co/datasets" not in card
    assert "| `rollout_engine` | `transformers.generate` |" in card
    # issue 48: the run summary names the engine with the card's one description (model_card.rollout_engine_record)
    assert results["engine"]["rollout_dtype"] == "float32" and "| `rollout_dtype` | `float32` |" in card
    assert "| `rollout_logprobs_mode` | `processed (log_softmax of the final processed scores)` |" in card
    assert results["engine"]["rollout_logprobs_mode"] == "processed (log_softmax of the final processed scores)"
    assert "not a Hub dataset" in card and "| `torch_threads` | `1` |" in card
    assert card.count("## Rollout correction (trl-rollout-corr)") == 1
    assert "trl-rollout-corr" in card.split("---")[1]  # a tag in the card's metadata (_tag_names)


class FakeHub:
    """``HfApi.create_repo`` / ``HfApi.upload_folder`` replaced at the class (the shared ``transformers`` client
    included): records each upload's files after huggingface_hub's own pattern filtering, with README.md's text (and
    the features' state file's step) as they were at upload time, done at the call (``run_as_future``: a finished
    future). Any other Hub call goes to ``HF_ENDPOINT`` = a closed local port and fails the test."""

    def __init__(self, monkeypatch):
        from huggingface_hub import HfApi

        self.repos, self.uploads = [], []
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setattr(HfApi, "create_repo", self.create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", self.upload_folder)

    def create_repo(self, repo_id, **kwargs):  # a bound method as class attribute: no HfApi self
        from huggingface_hub import RepoUrl

        self.repos.append(repo_id)
        return RepoUrl(f"http://127.0.0.1:9/{repo_id}", endpoint="http://127.0.0.1:9")

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, ignore_patterns=None,
                      allow_patterns=None, run_as_future=False, **kwargs):
        import torch
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        kept = list(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        readme = (root / "README.md").read_text() if "README.md" in kept else None
        features = root / "rollout_corr_features.rank-00000.pt"  # checkpoint_state's file, read at upload time
        state_step = torch.load(features, weights_only=False)["global_step"] if features.name in kept else None
        self.uploads.append({"repo_id": repo_id, "message": commit_message, "files": kept, "readme": readme,
                             "path_in_repo": kwargs.get("path_in_repo"), "state_step": state_step})
        if not run_as_future:
            return None
        from concurrent.futures import Future

        done = Future()  # uploaded already, at call time: the Trainer's push-in-progress check sees it done
        done.set_result(None)
        return done


def test_push_to_hub_uploads_the_card_with_the_correction_section(chat_llama_dir, tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch)
    out = tmp_path / "pushed"
    _run(chat_llama_dir, out, "--max_steps", "2", "--push_to_hub", "true", "--hub_model_id", "someone/tiny-rc",
         "--save_strategy", "steps", "--save_steps", "1", "--hub_strategy", "end")
    assert hub.repos and set(hub.repos) == {"someone/tiny-rc"}
    # save_model (push_to_hub=True pushes) and the recipe's push_to_hub: each upload carries the card with the section
    assert [u["message"] for u in hub.uploads] == ["Model save", "End of training"]
    for upload in hub.uploads:
        assert upload["repo_id"] == "someone/tiny-rc"
        assert "model.safetensors" in upload["files"] and "README.md" in upload["files"]
        assert not any(f.startswith("checkpoint-") for f in upload["files"])
        card = upload["readme"]
        assert card.count("## Rollout correction (trl-rollout-corr)") == 1
        assert "| `rollout_corr_preset` | `decoupled_k3_rs_token_tis` |" in card
        assert "| `rollout_rs` | `seq_mean_k3` |" in card and "| `rollout_engine` | `transformers.generate` |" in card
        assert "# Model Card for tiny-rc" in card and "huggingface.co/datasets" not in card
    local = (out / "README.md").read_text()
    assert local == hub.uploads[-1]["readme"]  # the local card keeps the section too


def test_hub_strategy_checkpoint_pushes_the_feature_state_with_each_checkpoint(chat_llama_dir, tmp_path,
                                                                               monkeypatch):
    """transformers pushes a checkpoint (``_push_from_checkpoint``) before the callbacks' ``on_save``: the pushed
    ``last-checkpoint`` must already hold the features' state file of its own step (``save_before_push``), written
    once per checkpoint, so a run resumed from the Hub's checkpoint restores the features instead of starting them
    fresh."""
    import torch

    from trl_rollout_corr import checkpoint_state

    saved = []
    real_save = checkpoint_state.save

    def counting_save(trainer, folder):
        saved.append(Path(folder).name)
        return real_save(trainer, folder)

    monkeypatch.setattr(checkpoint_state, "save", counting_save)
    hub = FakeHub(monkeypatch)
    out = tmp_path / "pushed_ckpt"
    _run(chat_llama_dir, out, "--max_steps", "2", "--push_to_hub", "true", "--hub_model_id", "someone/tiny-rc",
         "--save_strategy", "steps", "--save_steps", "1", "--hub_strategy", "checkpoint", "--hub_always_push", "true")
    pushed = [u for u in hub.uploads if u["path_in_repo"] == "last-checkpoint"]
    assert [u["message"] for u in pushed] == ["Training in progress, step 1, checkpoint",
                                             "Training in progress, step 2, checkpoint"]
    for step, upload in enumerate(pushed, start=1):
        assert "rollout_corr_features.rank-00000.pt" in upload["files"] and "trainer_state.json" in upload["files"]
        assert upload["state_step"] == step  # the file of the pushed checkpoint's own step
    assert saved == ["checkpoint-1", "checkpoint-2"]  # once per checkpoint: on_save did not write it again
    for step in (1, 2):
        local = torch.load(out / f"checkpoint-{step}" / "rollout_corr_features.rank-00000.pt", weights_only=False)
        assert local["global_step"] == step
