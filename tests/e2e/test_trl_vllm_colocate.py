"""TRL's own vLLM colocate path (``use_vllm=True, vllm_mode="colocate"``) on vLLM CPU, for real (issue 43).

``RolloutCorrGRPOTrainer`` builds TRL's colocate engine through ``trl_compat.trl_vllm_colocate``: eager on CPU,
``rollout_vllm_dtype`` passed to TRL's ``vllm.LLM``, and TRL's weight sync wrapped in vLLM's layerwise reload plus
the tied-head re-pack (without them a float32 engine fails at the first sync with ``'Parameter' object has no
attribute 'weight_loader'``, and after a sync its LM head would be stale).

The real-vLLM tests need the ``.venv-vllm`` environment and the converted SmolLM2 (``TRL_ROLLOUT_CORR_SMOLLM2``);
they skip cleanly otherwise. The pins and config checks at the top run anywhere in seconds.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
from pathlib import Path

import pytest
import torch

from trl_rollout_corr import trl_compat

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", ROOT / "models" / "SmolLM2-135M-Instruct"))
TEMPERATURE = 0.7  # processed log-probs (T = 0.7) differ from the raw ones: the check can tell the two apart


# ---------------------------------------------------------------------------------------------------------------
# Pins of the TRL 1.16 coupling and the config checks (no vLLM needed)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_pin_trl_colocate_coupling():
    """What trl_compat.trl_vllm_colocate relies on in TRL 1.16; fails loudly when TRL changes it."""
    import trl
    import trl.generation.vllm_generation as trl_vllm
    import trl.trainer.grpo_trainer as grpo
    from trl import GRPOConfig, GRPOTrainer

    assert trl.__version__.startswith("1.16."), trl.__version__
    assert grpo.VLLMGeneration is trl_vllm.VLLMGeneration  # the module-level name GRPOTrainer.__init__ calls
    assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(GRPOTrainer.__init__)
    init_vllm = inspect.getsource(trl_vllm.VLLMGeneration._init_vllm)
    assert init_vllm.count("LLM(") == 1 and "self.llm = LLM(" in init_vllm  # one vllm.LLM call, by module name
    call = init_vllm[init_vllm.index("self.llm = LLM("):]
    call = call[:call.index("\n            )")]
    for name in trl_compat.COLOCATE_LLM_KWARGS:  # TRL does not pass them: adding them overrides nothing
        assert f"{name}=" not in call, name
    assert 'logprobs_mode="processed_logprobs"' in call and 'distributed_executor_backend="external_launcher"' in call
    sync = inspect.getsource(trl_vllm.VLLMGeneration.sync_weights)
    assert "self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param)])" in sync
    assert "self.llm.reset_prefix_cache()" in sync
    # TRL syncs whenever the optimizer step changed (every step) and has no sync-frequency knob in 1.16
    generate = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "if self.state.global_step != self._last_loaded_step:" in generate
    assert "self.vllm_generation.sync_weights()" in generate
    assert not [f for f in GRPOConfig.__dataclass_fields__ if "sync_freq" in f or f.startswith("vllm_sync")]
    assert list(inspect.signature(trl_vllm.VLLMGeneration.generate).parameters)[:2] == ["self", "prompts"]


@pytest.mark.unit
def test_trl_vllm_colocate_swaps_the_class_for_the_block_only():
    import trl.trainer.grpo_trainer as grpo

    trl_class = grpo.VLLMGeneration
    with trl_compat.trl_vllm_colocate({"dtype": "float32"}, layerwise_sync=True):
        built = grpo.VLLMGeneration
        assert built.func is trl_compat.colocate_generation_class() and issubclass(built.func, trl_class)
        assert built.keywords == {"llm_kwargs": {"dtype": "float32"}, "layerwise_sync": True}
    assert grpo.VLLMGeneration is trl_class
    with pytest.raises(RuntimeError, match="boom"), trl_compat.trl_vllm_colocate({}, layerwise_sync=False):
        raise RuntimeError("boom")
    assert grpo.VLLMGeneration is trl_class  # restored on error
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        with trl_compat.trl_vllm_colocate({"gpu_memory_utilization": 0.5}, layerwise_sync=False):
            pass


@pytest.mark.unit
def test_colocate_engine_fields_are_refused_off_the_colocate_path(tmp_path):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="use_vllm=False"):
        RolloutCorrGRPOConfig(**base, rollout_vllm_dtype="float32")
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        RolloutCorrGRPOConfig(**base, use_vllm=True, vllm_mode="server", rollout_vllm_enforce_eager=True)
    with pytest.raises(ValueError, match="'bfloat16' or 'float32'"):
        RolloutCorrGRPOConfig(**base, use_vllm=True, vllm_mode="colocate", rollout_vllm_dtype="auto")
    args = RolloutCorrGRPOConfig(**base, use_vllm=True, vllm_mode="colocate", rollout_vllm_dtype="float32",
                                 rollout_corr_preset="decoupled_k3_rs_token_tis")
    assert args.rollout_vllm_dtype == "float32" and args.vllm_importance_sampling_correction is False


# ---------------------------------------------------------------------------------------------------------------
# Real vLLM CPU colocate engines, SmolLM2-135M: float32 (packed layers: the case TRL's plain sync fails on) and bf16
# ---------------------------------------------------------------------------------------------------------------
def _needs_vllm_and_model():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (use the .venv-vllm environment)")
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"converted SmolLM2 not found at {MODEL_DIR} (python recipes/convert_smollm2.py)")


PROMPTS = ["What is 2+3?", "Name a color.", "What is 7 times 8?", "Who wrote Hamlet?"]


def _reward(completions, **kwargs):
    """Deterministic and varied: digits count up, length counts down (a non-zero advantage in most groups)."""
    return [0.2 * sum(ch.isdigit() for ch in str(c)) - 0.01 * len(str(c)) for c in completions]


def _top_p_log_probs(log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N, V) log-probs renormalised over the top-p nucleus (a token is kept while the mass ranked above it is below
    top_p, as vLLM's sampler does); -inf outside it."""
    if top_p >= 1.0:
        return log_probs
    sorted_lp, order = log_probs.sort(-1, descending=True)
    probs = sorted_lp.exp()
    keep_sorted = (probs.cumsum(-1) - probs) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = log_probs.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


@torch.no_grad()
def _reference_log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, top_p):
    """Independent of TRL's scoring: a plain float32 ``transformers`` forward per row (no padding); at each completion
    token the log-softmax of logits / T over the top-p nucleus (processed, what vLLM samples from) and of the logits
    (raw). Returns two (B, T) tensors (0 at pads)."""
    processed = torch.zeros(completion_ids.shape)
    raw = torch.zeros(completion_ids.shape)
    for i in range(completion_ids.size(0)):
        p = prompt_ids[i][prompt_mask[i].bool()]
        n = int(completion_mask[i].sum())
        c = completion_ids[i, :n]
        logits = model(torch.cat([p, c])[None]).logits[0, p.numel() - 1: p.numel() + n - 1].float()
        scaled = _top_p_log_probs(torch.log_softmax(logits / temperature, -1), top_p)
        processed[i, :n] = scaled.gather(-1, c[:, None])[:, 0]
        raw[i, :n] = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
    return processed, raw


def _run(tmp_path, dtype: str, **config):
    """Train 2 steps with TRL's colocate engine in ``dtype``; returns the trainer and, per generation batch, what the
    engine returned and the independent re-score at the weights that generated it."""
    from datasets import Dataset

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    class Probe(RolloutCorrGRPOTrainer):
        captured: list = []
        syncs: list = []

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            model = self.accelerator.unwrap_model(self.model)
            processed, raw = _reference_log_probs(model, batch["prompt_ids"], batch["prompt_mask"],
                                                  batch["completion_ids"], batch["completion_mask"], self.temperature,
                                                  self.top_p)
            mu = batch.get("rollout_log_probs", batch.get("sampling_per_token_logps"))
            self.captured.append(dict(step=self.state.global_step, mu=mu.detach().float().clone(),
                                      mask=batch["completion_mask"].bool().clone(), processed=processed, raw=raw,
                                      versions=batch.get("rollout_policy_version"),
                                      synced_at=self.syncs[-1] if self.syncs else None))
            return batch

    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / f"{dtype}"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        use_vllm=True, vllm_mode="colocate", rollout_vllm_dtype=dtype, vllm_max_model_length=256,
        per_device_train_batch_size=8, num_generations=2, max_completion_length=16, temperature=TEMPERATURE,
        max_steps=2, learning_rate=2e-5, logging_steps=1, seed=0, beta=0.0, loss_type="dapo",
        model_init_kwargs={"dtype": "float32"}, **config)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    # vLLM CPU sizes the KV cache as vllm_gpu_memory_utilization (TRL: 0.3) of the machine's memory minus what the
    # process holds: 7 GiB here, and the next engine of this process finds too little; 1 GiB is plenty for 4 prompts
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        trainer = Probe(model=str(MODEL_DIR), reward_funcs=[_reward], args=args, train_dataset=dataset)
    finally:
        if kv_cache is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_cache
    gen = trainer.vllm_generation
    trl_sync = gen.sync_weights

    def sync_and_record():
        trl_sync()
        trainer.syncs.append(trainer.state.global_step)

    gen.sync_weights = sync_and_record
    trainer.train()
    return trainer


def _close_engine(trainer) -> None:
    """Shut the trainer's colocate engine down now (``VLLMGeneration.close``): several engines alive at once in this
    process peaked at 17 GB RSS and the OOM killer ended ``make test-vllm`` on a 24 GB machine."""
    trainer.vllm_generation.close()


@pytest.fixture(scope="module")
def float32_decoupled(tmp_path_factory):
    _needs_vllm_and_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _run(tmp_path_factory.mktemp("colocate"), "float32", rollout_corr_preset="decoupled_k3_rs_token_tis",
                   policy_lag_split=True, rollout_rs_on="engine", max_policy_lag=0,
                   rollout_dump_dir=str(tmp_path_factory.mktemp("records")))
    finally:
        torch.set_num_threads(threads)


def _engine_probe(trainer):
    """The engine's processed log-probs of fixed tokens (``prompt_logprobs``) against the trainer's current weights
    (float32 forward, temperature 1): max |difference| in nats."""
    from vllm import SamplingParams

    ids = trainer.processing_class("The capital of France is Paris. Two plus two is four.")["input_ids"]
    out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}],
                                               SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                                               use_tqdm=False)
    engine = torch.tensor([lp[t].logprob for lp, t in zip(out[0].prompt_logprobs[1:], ids[1:])])
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (engine - ref).abs().max().item()


def _check_mu_and_versions(trainer, bound: float) -> list[float]:
    """Per generation batch: mu against the independent processed re-score (max |diff| < bound) and far from the raw
    log-probs; every row's version is the step of the sync before it. Returns the max |diff| per batch."""
    assert trainer.syncs == [0, 1] and trainer.vllm_generation.num_syncs == 2  # TRL: one sync per optimizer step
    assert [c["step"] for c in trainer.captured] == [0, 1]
    worst = []
    for c in trainer.captured:
        m = c["mask"]
        assert m.sum() >= 40
        d_processed = (c["mu"] - c["processed"])[m].abs()
        d_raw = (c["mu"] - c["raw"])[m].abs()
        assert d_processed.max() < bound, (c["step"], d_processed.max())
        assert d_raw.mean() > 3 * d_processed.mean() + 0.05, (d_raw.mean(), d_processed.mean())
        # the version of every row is the optimizer step whose weights the engine held (the sync just before)
        assert torch.equal(c["versions"].cpu(), torch.full_like(c["versions"].cpu(), c["synced_at"]))
        worst.append(d_processed.max().item())
        print(f"step {c['step']}: |log mu - log pi| processed max {d_processed.max():.2e} mean "
              f"{d_processed.mean():.2e}, raw mean {d_raw.mean():.3f}")
    return worst


@pytest.mark.vllm
@pytest.mark.slow
def test_float32_colocate_features_work(float32_decoupled):
    """Decoupled mode with the lag split, RS on the engine factor, max_policy_lag 0 and records: all run on TRL's
    colocate path, and with a float32 engine the engine factor is 1 to float32 noise (nothing rejected for it)."""
    trainer = float32_decoupled
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert abs(h["rollout_corr/kl"]) < 1e-4, h["rollout_corr/kl"]
        assert h["rollout_corr/rollout_rs_engine_masked_fraction"] == 0.0
        assert h["rollout_corr/policy_lag_max"] == 0.0 and h["rollout_corr/policy_lag_dropped_fraction"] == 0.0
        assert h["rollout_corr/rollout_is_eff_sample_size"] > 0.999
        assert math.isfinite(h["loss"]) and h["grad_norm"] > 0
    records = list(Path(trainer.args.rollout_dump_dir).rglob("*.parquet"))
    assert records, "no rollout records written"
    from trl_rollout_corr import model_card
    from trl_rollout_corr.features.rollout_records import rollout_engine_record

    for record in (model_card.rollout_engine_record(trainer), rollout_engine_record(trainer)):
        assert record["rollout_engine"] == "trl_vllm_colocate" and record["rollout_dtype"] == "float32"


@pytest.mark.vllm
@pytest.mark.slow
def test_float32_colocate_mu_is_the_processed_log_prob_and_syncs_are_exact(float32_decoupled):
    trainer = float32_decoupled  # the fixture's last user: its engine is shut down at the end (_close_engine)
    _check_mu_and_versions(trainer, bound=1e-3)  # measured: max 2e-5 (float32 noise); raw 0.2+ nats
    gen = trainer.vllm_generation
    assert gen.describe()["rollout_engine"] == "trl_vllm_colocate" and gen.describe()["rollout_dtype"] == "float32"
    assert gen.llm.llm_engine.model_config.enforce_eager  # eager by default on CPU
    # after the optimizer steps the engine holds the trainer's new weights once synced again, embedding included
    before = _engine_probe(trainer)  # engine: step 1's weights; trainer: step 2's
    gen.sync_weights()
    after = _engine_probe(trainer)
    print(f"probe: engine vs trainer before the sync {before:.2e}, after {after:.2e}")
    _close_engine(trainer)
    assert after < 1e-4, after  # float32 noise
    assert before > 10 * after, (before, after)


@pytest.fixture  # one test uses it: its engine is shut down right after (_close_engine)
def bf16_decoupled(tmp_path_factory):
    _needs_vllm_and_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = _run(tmp_path_factory.mktemp("colocate_bf16"), "bfloat16",
                       rollout_corr_preset="decoupled_k3_rs_token_tis")
        yield trainer
        _close_engine(trainer)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.vllm
@pytest.mark.slow
def test_bf16_colocate_mu_and_synced_weights(bf16_decoupled):
    """A bf16 engine (vLLM's own CPU default for this checkpoint): mu is the processed log-prob up to the bf16
    mismatch; after a sync the weights the engine keeps as they are (embedding, norms) are the trainer's rounded to
    bf16 bit for bit (its linear layers are packed: the float32 probe above covers them)."""
    trainer = bf16_decoupled
    gen = trainer.vllm_generation
    assert gen.describe()["rollout_dtype"] == "bfloat16"
    _check_mu_and_versions(trainer, bound=1.5)  # measured: max 0.2-0.4, mean 0.035-0.038 nats; raw mean 0.29-0.30
    for c in trainer.captured:
        mean = (c["mu"] - c["processed"])[c["mask"]].abs().mean()
        assert 0.005 < mean < 0.1, mean
    gen.sync_weights()
    engine = dict(gen.llm.llm_engine.model_executor.driver_worker.model_runner.model.named_parameters())
    state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    kept = [name for name in state if name == "model.embed_tokens.weight" or name.endswith("norm.weight")]
    assert len(kept) == 2 + 2 * trainer.model.config.num_hidden_layers
    for name in kept:
        assert torch.equal(engine[name], state[name].to(torch.bfloat16)), name


@pytest.fixture  # one test uses it: its engine is shut down right after (_close_engine)
def float32_bypass_top_p(tmp_path_factory):
    _needs_vllm_and_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = _run(tmp_path_factory.mktemp("colocate_bypass"), "float32", rollout_corr_preset="bypass_pg_is",
                       top_p=0.9, rollout_support_matching="recompute")
        yield trainer
        _close_engine(trainer)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.vllm
@pytest.mark.slow
def test_float32_colocate_bypass_with_top_p_recompute(float32_bypass_top_p):
    """Bypass mode with support matching 'recompute' at top_p 0.9: mu is the log-prob renormalised over the nucleus
    (float32 noise against the independent re-score), and the trainer's support-matched log-probs agree with it."""
    trainer = float32_bypass_top_p
    _check_mu_and_versions(trainer, bound=1e-3)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert abs(h["rollout_corr/kl"]) < 1e-4, h["rollout_corr/kl"]
        assert math.isfinite(h["loss"]) and h["grad_norm"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_recipe_main_job_on_trl_colocate(tmp_path):
    """The main job's recipe with `--use_vllm --vllm_mode colocate` (2 steps): TRL's colocate engine samples in
    the config's rollout dtype, greedy accuracy before/after comes from it, and the run summary, log and model card
    name the path (trl_vllm_colocate) with the same engine record."""
    _needs_vllm_and_model()
    pytest.importorskip("reasoning_gym")
    import json

    from trl import ModelConfig, TrlParser

    from script_module import load_script

    recipe = load_script("recipes/grpo_rollout_corr.py", "grpo_rollout_corr_recipe_colocate")
    parser = TrlParser((recipe.ScriptArguments, recipe.RolloutCorrGRPOConfig, ModelConfig))
    out = tmp_path / "run"
    script_args, training_args, model_args = parser.parse_args_and_config(args=[
        "--config", str(ROOT / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"), "--model_name_or_path",
        str(MODEL_DIR), "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--max_completion_length", "32", "--eval_size", "8", "--train_size", "64", "--torch_threads", "1",
        "--plots", "false", "--report_to", "none", "--use_vllm", "--vllm_mode", "colocate"])
    threads = torch.get_num_threads()
    try:
        results = recipe.main(script_args, training_args, model_args)
    finally:
        torch.set_num_threads(threads)
    engine = results["engine"]
    assert engine["rollout_engine"] == "trl_vllm_colocate" and engine["rollout_dtype"] == "bfloat16"
    assert engine["rollout_enforce_eager"] is True and engine["rollout_logprobs_mode"] == "processed_logprobs"
    assert results["train"]["vllm_syncs"] == 2  # one per optimizer step, before its generation
    assert results["train"]["vllm_generate_s"] > 0 and results["train"]["vllm_sync_s"] > 0
    assert results["before"]["total"] == results["after"]["total"] == 8
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert {k: records[0]["run_config"][k] for k in engine} == engine
    steps = [r for r in records[1:] if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 < r["rollout_corr/k3_kl"] < 0.1 and r["rollout_corr/rollout_is_eff_sample_size"] > 0.8
    assert "| `rollout_engine` | `trl_vllm_colocate` |" in (out / "README.md").read_text()
    assert "trl_vllm_colocate" in (out / "summary.md").read_text()
