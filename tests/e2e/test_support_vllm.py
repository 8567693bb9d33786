"""Support matching against vLLM: the recompute in vLLM's order equals vLLM 0.32's own sampler operations, vLLM CPU
cannot return its kept-token sets, and ``VLLMCPURollout`` declares the sampler it samples with.

The tests marked ``vllm`` need the ``.venv-vllm`` environment (``make test-vllm``) and skip cleanly without vLLM; the
others run anywhere."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from trl_rollout_corr import support as S
from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _trainer_stub(**generation_kwargs):
    args = SimpleNamespace(generation_kwargs=generation_kwargs or None, temperature=1.0, top_p=0.9, top_k=0,
                           min_p=None, repetition_penalty=1.1)
    return SimpleNamespace(args=args, temperature=1.0, top_p=0.9, top_k=0, min_p=None, repetition_penalty=1.1,
                           max_completion_length=32)


def test_vllm_cpu_rollout_declares_the_sampler_it_samples_with():
    rollout = object.__new__(VLLMCPURollout)  # no engine needed: the contract comes from the sampling kwargs
    trainer = _trainer_stub(min_p=0.05, logit_bias={3: 1.0})
    spec = rollout.sampler_contract(trainer)
    assert spec.engine == "vllm"
    assert [(p.name, p.value, p.source) for p in spec.steps] == [
        ("repetition_penalty", 1.1, "SimpleNamespace.repetition_penalty"), ("min_p", 0.05, "generation_kwargs"),
        ("top_p", 0.9, "SimpleNamespace.top_p")]
    assert [p.name for p in spec.unsupported] == ["logit_bias"]
    assert rollout.sampling_kwargs(trainer)["min_p"] == 0.05  # the very kwargs __call__ passes to SamplingParams


def _random_batch(seed=0, b=3, prompt=5, completion=6, vocab=64, hidden_size=16):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=g) * 1.5
    hidden = torch.randn(b, prompt + completion, hidden_size, generator=g)
    ids = torch.randint(0, vocab // 2, (b, prompt + completion), generator=g)  # repeats: the penalties act
    ids[:, prompt::2] = (hidden[:, prompt - 1:-1] @ weight.t()).argmax(-1)[:, ::2]  # likely kept
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding (vLLM never sees it)
    return hidden, weight, ids, mask, completion


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("params", [
    dict(top_p=0.8), dict(top_k=10), dict(min_p=0.1, top_p=0.7, temperature=0.8),
    dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, temperature=1.2, top_k=20, top_p=0.9),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_recompute_equals_vllm_sampler_ops(params):
    """Per position: vLLM 0.32's penalties (prompt without padding + output so far), temperature, its min-p
    processor, then ``apply_top_k_top_p_pytorch`` (the CPU path), then log-softmax (processed_logprobs)."""
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    hidden, weight, ids, mask, T = _random_batch()
    vocab, P = weight.size(0), ids.size(1) - T
    score = S.SupportScorer(S.sampler_from_vllm_params(params), "recompute").score(hidden, weight, None, ids, mask, T)
    one = lambda name, default: torch.tensor([float(params.get(name, default))])  # noqa: E731
    checked = 0
    for r in range(ids.size(0)):
        for s in range(T):
            logits = (hidden[r, P + s - 1] @ weight.t()).unsqueeze(0).float()
            prompt = ids[r, :P][mask[r, :P] != 0].unsqueeze(0)
            output = ids[r, P:P + s].unsqueeze(0) if s else torch.full((1, 1), vocab)
            logits = apply_penalties(logits, prompt, output, one("presence_penalty", 0), one("frequency_penalty", 0),
                                     one("repetition_penalty", 1))
            logits = logits.div_(float(params.get("temperature", 1.0)))
            if "min_p" in params:
                min_p = object.__new__(MinPLogitsProcessor)
                min_p.min_p_count, min_p.min_p = 1, torch.tensor([[params["min_p"]]])
                logits = min_p.apply(logits)
            k = torch.tensor([params["top_k"]]) if "top_k" in params else None
            p = torch.tensor([params["top_p"]]) if "top_p" in params else None
            logits = apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
            kept, a = torch.isfinite(logits[0]), ids[r, P + s]
            assert score.size[r, s] == kept.sum(), (r, s)
            assert bool(score.miss[r, s]) == (not kept[a])
            if kept[a]:
                checked += 1
                torch.testing.assert_close(score.log_probs[r, s], logits.log_softmax(-1)[0, a], atol=1e-5, rtol=0)
    assert checked > 0


@pytest.mark.vllm
@needs_vllm
def test_vllm_cpu_cannot_return_sampling_masks(tmp_path):
    """vLLM 0.32 returns kept-token sets only with return_sampling_mask=True on Model Runner V2, which needs Triton:
    on CPU the engine config is refused, hence rollout_support_matching='replay' is refused on the vLLM paths."""
    import os

    from vllm.engine.arg_utils import EngineArgs

    from tiny_model import make_tiny_model_dir

    model_dir = make_tiny_model_dir(str(tmp_path / "m"), "llama")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_args = EngineArgs(model=model_dir, dtype="float32", return_sampling_mask=True, enforce_eager=True,
                             logprobs_mode="processed_logprobs", max_model_len=128)
    with pytest.raises(Exception, match="requires Model Runner V2"):
        engine_args.create_engine_config()
