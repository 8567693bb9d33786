"""engines.transformers_generate: behaviour log-probs (mu) from ``transformers.generate`` and generation from a
down-cast copy of the weights (``generate_in_dtype``), on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_model import make_tiny_model
from trl_rollout_corr.engines.transformers_generate import (
    behaviour_log_probs_from_scores,
    capture_generate_log_probs,
    cast_floating_weights,
    generate_in_dtype,
    resolve_generate_dtype,
)


# ---------------------------------------------------------------------------------------------- transformers.generate
def test_generate_log_probs_match_processed_distribution():
    """log mu from processed scores == log_softmax(top-k of logits / T) recomputed from a full forward."""
    model, tok = make_tiny_model("llama", seed=3)
    model.eval()
    prompt = torch.tensor([[tok.bos_token_id, 5, 6, 7], [tok.bos_token_id, 9, 9, 10]])
    temperature, top_k = 0.7, 5
    torch.manual_seed(0)
    with capture_generate_log_probs(model) as capture:
        seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                              temperature=temperature, top_k=top_k, top_p=1.0, max_new_tokens=6,
                              pad_token_id=tok.pad_token_id, eos_token_id=[])
    assert "generate" not in vars(model)  # the shadow is removed
    assert torch.is_tensor(seqs) and seqs.shape == (2, 10)
    log_mu = capture.log_probs[0]
    with torch.no_grad():
        logits = model(input_ids=seqs).logits[:, 3:-1].float() / temperature
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    expected = torch.log_softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)
    expected = expected.gather(-1, seqs[:, 4:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_mu, expected, atol=2e-5, rtol=0)
    # lists cut to each completion, checked token for token
    rows = capture.completion_log_probs([seqs[0, 4:7].tolist(), seqs[1, 4:].tolist()])
    assert [len(r) for r in rows] == [3, 6]
    with pytest.raises(ValueError, match="Row 1"):
        capture.completion_log_probs([seqs[0, 4:7].tolist(), (seqs[1, 4:] + 1).tolist()])
    with pytest.raises(ValueError, match="Row 0"):
        capture.completion_log_probs([seqs[0, 4:].tolist() + [1], seqs[1, 4:].tolist()])


def test_streaming_recorder_equals_output_scores_reference():
    """The O(B*V) recorder gives bit-for-bit the values of log_softmax(output_scores) for every sampling transform."""
    model, tok = make_tiny_model("qwen2", seed=5)
    model.eval()
    prompt = torch.tensor([[tok.bos_token_id, 5, 6, 7], [tok.bos_token_id, 9, 9, 10], [tok.bos_token_id, 3, 4, 4]])
    torch.manual_seed(1)
    with capture_generate_log_probs(model) as capture:
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=0.7,
                             top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.3, max_new_tokens=7,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             output_scores=True, return_dict_in_generate=True)
    assert not torch.is_tensor(out)  # the caller's return_dict_in_generate is respected
    reference = behaviour_log_probs_from_scores(out.scores, out.sequences, prompt_length=4)
    torch.testing.assert_close(capture.log_probs[0], reference, atol=0, rtol=0)
    assert torch.isfinite(reference[:, 0]).all()
    assert "_get_logits_processor" not in vars(model) and "generate" not in vars(model)


def test_generate_log_probs_from_scores_by_hand():
    scores = (torch.tensor([[0.0, math.log(3.0), -float("inf")]]), torch.tensor([[math.log(2.0), 0.0, 0.0]]))
    seqs = torch.tensor([[7, 1, 0]])
    out = behaviour_log_probs_from_scores(scores, seqs, prompt_length=1)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.5)]]))


def test_greedy_generation_is_refused():
    model, tok = make_tiny_model("llama", seed=3)
    with capture_generate_log_probs(model), pytest.raises(ValueError, match="do_sample=True"):
        model.generate(input_ids=torch.tensor([[2, 5]]), do_sample=False, max_new_tokens=2)



# ---------------------------------------------------------------------------------------------- generate_in_dtype
def _snapshot(model):
    return {name: (t.data_ptr(), t.dtype, t.detach().clone()) for name, t in
            list(model.named_parameters()) + list(model.named_buffers())}


def test_cast_floating_weights_restores_bit_exactly():
    model, _ = make_tiny_model("llama", seed=3)
    model.register_buffer("step_count", torch.tensor([3]))  # a non-floating buffer is left alone
    before = _snapshot(model)
    params_before = [id(p) for p in model.parameters()]
    with cast_floating_weights(model, torch.bfloat16):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # floating buffers too, as model.to()
        assert model.step_count.dtype == torch.long
    after = _snapshot(model)
    assert [id(p) for p in model.parameters()] == params_before  # the optimizer's parameters are untouched
    for name, (ptr, dtype, value) in before.items():
        assert after[name][0] == ptr and after[name][1] == dtype, name  # the very same storage
        assert torch.equal(after[name][2], value), name
    with pytest.raises(RuntimeError, match="boom"), cast_floating_weights(model, torch.float16):
        raise RuntimeError("boom")
    assert all(torch.equal(t.detach(), before[n][2]) for n, t in model.named_parameters())  # restored on error


def test_generate_in_dtype_samples_from_the_cast_weights_and_composes_with_capture():
    model, tok = make_tiny_model("llama", seed=3)
    model.eval()
    prompt = torch.tensor([[tok.bos_token_id, 5, 6, 7], [tok.bos_token_id, 9, 9, 10]])
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=5,
                  pad_token_id=tok.pad_token_id, eos_token_id=[])
    before = _snapshot(model)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.lm_head.weight.dtype))
    with generate_in_dtype(model, "bfloat16"), capture_generate_log_probs(model) as capture:
        assert next(model.parameters()).dtype == torch.float32  # cast only while generate runs
        torch.manual_seed(0)
        seqs = model.generate(**kwargs)
    assert seen and set(seen) == {torch.bfloat16}
    assert "generate" not in vars(model)
    assert all(torch.equal(t.detach(), before[n][2]) for n, t in model.named_parameters())
    # mu is that of the bf16 sampler: it differs from the float32 model's log-probs of the same tokens
    with torch.no_grad():
        fp32 = torch.log_softmax(model(input_ids=seqs).logits[:, 3:-1].float(), dim=-1)
    fp32 = fp32.gather(-1, seqs[:, 4:].unsqueeze(-1)).squeeze(-1)
    diff = (capture.log_probs[0] - fp32).abs().max().item()
    assert 1e-4 < diff < 0.5
    with generate_in_dtype(model, None):  # unset: generate is not touched
        assert "generate" not in vars(model)


def test_generate_dtype_names():
    assert resolve_generate_dtype("bfloat16") is torch.bfloat16 and resolve_generate_dtype(None) is None
    assert resolve_generate_dtype(torch.float16) is torch.float16
    for bad in ("bf16", torch.int8, "float64"):
        with pytest.raises(ValueError, match="bfloat16, float16, float32"):
            resolve_generate_dtype(bad)


def test_recorded_kept_sets_equal_the_finite_output_scores():
    """record_support=True: each row's kept-token sets are exactly where generate's processed scores were finite
    (output_scores reference), cut to the caller's completions; the log-probs are unchanged; the processors generate
    applied are recorded."""
    model, tok = make_tiny_model("qwen2", seed=5)
    model.eval()
    prompt = torch.tensor([[tok.bos_token_id, 5, 6, 7], [tok.bos_token_id, 9, 9, 10]])
    torch.manual_seed(1)
    with capture_generate_log_probs(model, record_support=True) as capture:
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=10,
                             top_p=0.8, no_repeat_ngram_size=2, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                             eos_token_id=[], output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(capture.log_probs[0], behaviour_log_probs_from_scores(out.scores, out.sequences, 4),
                               atol=0, rtol=0)
    completions = [out.sequences[0, 4:].tolist(), out.sequences[1, 4:7].tolist()]
    capture.completion_log_probs(completions)
    kept = capture.completion_kept_tokens(completions)
    assert [len(k) for k in kept] == [6, 3]
    for row, k in enumerate(kept):
        expected = torch.stack([torch.isfinite(out.scores[t][row]) for t in range(len(k))])
        assert torch.equal(k.mask(), expected)
    assert [type(p).__name__ for p in capture.processors[0]] == [
        "NoRepeatNGramLogitsProcessor", "TopKLogitsWarper", "TopPLogitsWarper"]
    with capture_generate_log_probs(model) as plain:
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=2,
                       pad_token_id=tok.pad_token_id, eos_token_id=[])
    with pytest.raises(RuntimeError, match="record_support=True"):
        plain.completion_kept_tokens([[1, 2], [3, 4]])
