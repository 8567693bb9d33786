"""One extra's environment, checked as a user gets it: run by ``make test-extras`` in a fresh venv that holds only
``pip install -c constraints/cpu.txt ".[EXTRA]"`` (not a pytest file: it needs its own venv).

    python tests/helpers/extras_smoke.py peft

Checks that ``trl_rollout_corr`` is the installed copy (not this source tree), that the trainer imports, that the
extra's own packages import, and trains one GRPO step on a tiny random model (``tiny_model.py``, next to this file)
with decoupled token TIS + seq_mean_k3 RS; with ``peft`` the step trains a LoRA adapter and saves it. Exits non-zero
(an exception) on any failure; prints one line per check.
"""

from __future__ import annotations

import importlib
import math
import sys
import tempfile
from pathlib import Path

# The packages each extra promises (import names), beyond the trainer stack.
EXTRA_IMPORTS = {
    "cpu": ["vllm", "reasoning_gym", "matplotlib", "gguf", "tensorboard", "trackio"],
    "trl,test": ["pytest", "hypothesis"],
    "deepspeed": ["deepspeed"],
    "peft": ["peft"],
}


def main(extra: str) -> None:
    import trl_rollout_corr

    installed = Path(trl_rollout_corr.__file__).resolve()
    assert installed.parent.parent.name == "site-packages", f"imported the source tree, not the install: {installed}"
    print(f"[{extra}] trl_rollout_corr from {installed.parent}")
    import torch

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    for name in EXTRA_IMPORTS[extra]:
        importlib.import_module(name)
    print(f"[{extra}] imports: trainer, {', '.join(EXTRA_IMPORTS[extra])}")

    from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(str(Path(tmp) / "model"), "llama", seed=0)
        args = RolloutCorrGRPOConfig(
            output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, max_steps=1, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
            save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, rollout_corr_preset="decoupled_k3_rs_token_tis",
        )
        peft_config = None
        if extra == "peft":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                         train_dataset=prompt_dataset(8), peft_config=peft_config)
        trainer.train()
        (step,) = [h for h in trainer.state.log_history if "loss" in h]
        assert math.isfinite(step["loss"]) and step["rollout_corr/num_valid_tokens"] > 0, step
        print(f"[{extra}] one GRPO step: loss {step['loss']:.4f}, {step['rollout_corr/num_valid_tokens']:.0f} valid "
              f"tokens, rollout_corr/kl {step['rollout_corr/kl']:.2e}")
        if peft_config is not None:
            trainer.save_model(args.output_dir)
            saved = sorted(p.name for p in Path(args.output_dir).iterdir())
            assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved
            print(f"[{extra}] saved a LoRA adapter: {saved}")


if __name__ == "__main__":
    main(sys.argv[1])
