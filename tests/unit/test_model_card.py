"""The model card the trainer owns (trl_rollout_corr/model_card.py, RolloutCorrGRPOTrainer.create_model_card), and
pins of the TRL 1.16 card machinery it hooks into."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

from trl_rollout_corr import model_card


def test_render_section_tables_in_order():
    text = model_card.render_section({"rollout_is": "token"}, {"rollout_engine": "vllm_cpu"},
                                     {"task": {"name": "chain_sum"}})
    assert text.startswith(model_card.BEGIN) and text.rstrip().endswith(model_card.END)
    body = text.splitlines()
    rows = [line for line in body if line.startswith("| `")]
    assert rows == ["| `rollout_is` | `token` |", "| `rollout_engine` | `vllm_cpu` |", "| `name` | `chain_sum` |"]
    heads = [line for line in body if line.endswith("| value |")]
    assert heads == ["| correction field | value |", "| rollout engine | value |", "| task | value |"]


def test_write_section_replaces_instead_of_appending(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("---\ntags: [trl]\n---\n# Model Card for x\n\nTRL text.\n")
    model_card.write_section(readme, model_card.render_section({"a": 1}, {"e": "one"}))
    model_card.write_section(readme, model_card.render_section({"a": 2}, {"e": "two"}))
    text = readme.read_text()
    assert text.count(model_card.BEGIN) == 1 and "| `a` | `2` |" in text and "| `a` | `1` |" not in text
    assert text.startswith("---\ntags: [trl]\n---\n# Model Card for x\n\nTRL text.\n\n" + model_card.BEGIN)
    # text PEFT appends after the section survives a rewrite
    readme.write_text(text + "\n### Framework versions\n\n- PEFT 0.21.2\n")
    model_card.write_section(readme, model_card.render_section({"a": 3}, {"e": "three"}))
    text = readme.read_text()
    assert "| `a` | `3` |" in text and text.endswith("- PEFT 0.21.2\n") and text.count(model_card.END) == 1


def _trainer(tmp_path, **overrides):
    args = SimpleNamespace(output_dir=str(tmp_path / "run-7"), bf16=False, rollout_generate_dtype=None,
                           vllm_mode="colocate", rollout_corr_preset="decoupled_token_is",
                           rs_keep_rejected_in_baseline=False, vllm_importance_sampling_correction=False,
                           rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                           rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False, bypass_loss_type="ppo_clip",
                           rollout_rs_on="direct", rollout_m2_threshold=None)
    import torch

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(_name_or_path="/models/SmolLM2-135M-Instruct")
    trainer = SimpleNamespace(args=args, model=model, rollout_func=None, use_vllm=False, hub_model_id=None,
                              model_card_sections={"task": {"name": "chain_sum"}})
    for key, value in overrides.items():
        setattr(trainer, key, value)
    return trainer


def test_rollout_engine_record_per_source(tmp_path):
    import transformers

    trainer = _trainer(tmp_path)
    assert model_card.rollout_engine_record(trainer) == {
        "rollout_engine": "transformers.generate", "rollout_engine_version": transformers.__version__,
        "rollout_dtype": "float32", "rollout_logprobs_mode": "processed (log_softmax of the final processed scores)"}
    trainer.args.bf16 = True
    assert model_card.rollout_engine_record(trainer)["rollout_dtype"] == "float32 (bf16 autocast)"
    trainer.args.rollout_generate_dtype = "float16"
    assert model_card.rollout_engine_record(trainer)["rollout_dtype"] == "float16 (bf16 autocast)"
    trainer.args.bf16 = False
    assert model_card.rollout_engine_record(trainer)["rollout_dtype"] == "float16"
    # issue 44, item 6: TRL's continuous batching (generate_batch) casts to the training dtype and returns no mu
    batching = _trainer(tmp_path, use_transformers_continuous_batching=True)
    assert model_card.rollout_engine_record(batching) == {
        "rollout_engine": "transformers continuous batching (generate_batch)", "rollout_dtype": "float32",
        "rollout_logprobs_mode": "none (continuous batching returns no log-probs)"}
    batching.args.bf16 = True
    assert model_card.rollout_engine_record(batching)["rollout_dtype"] == "bfloat16"
    assert model_card.rollout_engine_record(_trainer(tmp_path, use_vllm=True)) == {
        "rollout_engine": "trl_vllm_colocate", "rollout_logprobs_mode": "processed_logprobs"}
    described = SimpleNamespace(describe=lambda: {"rollout_engine": "vllm_cpu", "rollout_dtype": "bfloat16"})
    assert model_card.rollout_engine_record(_trainer(tmp_path, rollout_func=described))["rollout_dtype"] == "bfloat16"

    def my_rollout(prompts, trainer):
        return {}

    record = model_card.rollout_engine_record(_trainer(tmp_path, rollout_func=my_rollout))
    assert record == {"rollout_engine": "rollout_func test_rollout_engine_record_per_source.<locals>.my_rollout",
                      "rollout_logprobs_mode": "as returned by the rollout_func"}


def test_card_records_and_summary_describe_the_engine_with_one_function(tmp_path):
    """Issue 48: the model card, the rollout records' run.json and the recipe's run summary name the engine through
    ``model_card.rollout_engine_record`` alone (the records once had a second describer that named a plain function
    ``rollout_func function`` and gave transformers.generate other strings than the card)."""
    import ast

    from trl_rollout_corr.features import rollout_records

    assert rollout_records.rollout_engine_record is model_card.rollout_engine_record

    def plain(prompts, trainer):
        return {}

    trainer = _trainer(tmp_path, rollout_func=plain, use_transformers_continuous_batching=False)
    assert rollout_records.rollout_engine_record(trainer)["rollout_engine"] == (
        "rollout_func test_card_records_and_summary_describe_the_engine_with_one_function.<locals>.plain")
    # no other module of the package or the recipe builds an engine record of its own from a trainer
    root = Path(__file__).resolve().parents[2]
    defining = sorted(str(p.relative_to(root)) for p in [*root.glob("trl_rollout_corr/**/*.py"),
                                                          *root.glob("recipes/*.py")]
                      if any(isinstance(n, ast.FunctionDef) and n.name == "rollout_engine_record"
                             for n in ast.walk(ast.parse(p.read_text()))))
    assert defining == ["trl_rollout_corr/model_card.py"]
    # the recipe's summary: tests/e2e/test_recipe_tiny.py::test_outputs_a_person_reads (results.json == the card)


def test_complete_card_mends_trls_none_placeholders(tmp_path):
    trainer = _trainer(tmp_path)
    readme = Path(trainer.args.output_dir) / "README.md"
    readme.parent.mkdir(parents=True)
    readme.write_text(f"# Model Card for run-7\n\nThis model is a fine-tuned version of "
                      f"{model_card.TRL_NO_BASE_MODEL}.\n\n"
                      f"generator = pipeline('text-generation', {model_card.TRL_NO_HUB_ID})\n")
    model_card.complete_card(readme, trainer)
    text = readme.read_text()
    assert "None" not in text.split(model_card.BEGIN)[0]  # (the section's `rollout_rs` | `None` is a real value)
    assert "fine-tuned version of `SmolLM2-135M-Instruct` (local weights: `/models/SmolLM2-135M-Instruct`)." in text
    assert f'model="{Path(trainer.args.output_dir).resolve()}"' in text
    assert "| `rollout_corr_preset` | `decoupled_token_is` |" in text and "| `name` | `chain_sum` |" in text


def test_pin_trl_card_machinery():
    """What create_model_card relies on in TRL 1.16: its signature, who calls it, the template's None renderings."""
    import trl
    from transformers import Trainer
    from trl import GRPOTrainer

    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    assert trl.__version__.startswith("1.16."), trl.__version__
    assert list(inspect.signature(GRPOTrainer.create_model_card).parameters) == [
        "self", "model_name", "dataset_name", "tags"]
    assert 'model_card.save(os.path.join(self.args.output_dir, "README.md"))' in inspect.getsource(
        GRPOTrainer.create_model_card)
    assert "self.create_model_card(model_name=model_name)" in inspect.getsource(GRPOTrainer._save_checkpoint)
    assert "self.create_model_card(model_name=model_name, **kwargs)" in inspect.getsource(Trainer.push_to_hub)
    template = (Path(trl.__file__).parent / "templates" / "lm_model_card.md").read_text()
    assert "[{{ base_model }}](https://huggingface.co/{{ base_model }})" in template  # -> TRL_NO_BASE_MODEL
    assert 'model="{{ hub_model_id }}"' in template  # -> TRL_NO_HUB_ID
    assert RolloutCorrGRPOTrainer._tag_names == ["trl", "grpo", "trl-rollout-corr", "rollout-correction"]
