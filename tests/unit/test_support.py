"""support/: the sampler contract, the support computation (against hand-computed values, transformers' own
logits processors and finite differences), the kept-token sets and the support metrics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trl_rollout_corr import support as S

# ------------------------------------------------------------------------------ a constructed distribution
# Three next-token distributions over V = 6 (identity LM head: the logits are log p), the sampled token of each.
PROBS = [
    [0.5, 0.2, 0.15, 0.1, 0.04, 0.01],
    [0.9, 0.05, 0.03, 0.01, 0.005, 0.005],
    [0.3, 0.25, 0.2, 0.15, 0.06, 0.04],
]
SAMPLED = [1, 0, 4]
# Kept sets by hand. top_p 0.8: drop the tokens whose ascending cumulative mass is <= 0.2.
#   row 0: cum .01 .05 .15 | .30 ... -> keep {.5, .2, .15}, S = .85; row 1: keep {.9}, S = .9;
#   row 2: cum .04 .10 | .25 -> keep {.3, .25, .2, .15}, S = .9 (the sampled .06 is outside: a miss).
# top_k 2: {.5, .2} .7 / {.9, .05} .95 / {.3, .25} .55 (miss). min_p .35: p >= .35 max p:
#   row 0: >= .175 -> {.5, .2} .7; row 1: >= .315 -> {.9}; row 2: >= .105 -> {.3, .25, .2, .15} .9 (miss).
HAND = {
    "top_p": (0.8, [[0, 1, 2], [0], [0, 1, 2, 3]]),
    "top_k": (2, [[0, 1], [0, 1], [0, 1]]),
    "min_p": (0.35, [[0, 1], [0], [0, 1, 2, 3]]),
}


def _constructed_batch():
    """One row: a 1-token prompt, then the three sampled tokens; hidden state i holds log p of position i."""
    logits = torch.tensor(PROBS, dtype=torch.float64).log()
    hidden = torch.cat([logits, logits[:1]]).unsqueeze(0)  # (1, 4, 6): positions 0..2 predict tokens 1..3
    input_ids = torch.tensor([[5] + SAMPLED])
    return hidden, torch.eye(6, dtype=torch.float64), input_ids, torch.ones_like(input_ids)


@pytest.mark.parametrize("name", sorted(HAND))
def test_support_metrics_equal_hand_computed_values(name):
    value, kept = HAND[name]
    spec = S.sampler_from_generation_config({"do_sample": True, name: value})
    hidden, weight, ids, mask = _constructed_batch()
    score = S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, logits_to_keep=3)
    mass = [sum(PROBS[i][v] for v in kept[i]) for i in range(3)]
    assert score.size[0].tolist() == [len(k) for k in kept]
    torch.testing.assert_close(score.log_mass[0], torch.tensor(mass, dtype=torch.float64).log())
    miss = [SAMPLED[i] not in kept[i] for i in range(3)]
    assert score.miss[0].tolist() == miss == [False, False, True]
    # log pi(a) = log p_a - log S, the support extended by a for the miss
    expected = [math.log(PROBS[i][a] / (mass[i] + (PROBS[i][a] if miss[i] else 0.0))) for i, a in enumerate(SAMPLED)]
    torch.testing.assert_close(score.log_probs[0], torch.tensor(expected, dtype=torch.float64))
    metrics = S.SupportStats.from_score(score, mask[:, 1:]).finalize()
    sizes = sorted(len(k) for k in kept)
    p99 = sizes[1] + 0.98 * (sizes[2] - sizes[1])  # linear interpolation at 0.99 * (3 - 1) = 1.98
    assert metrics == pytest.approx({
        "rollout_corr/support_log_mass_mean": sum(math.log(m) for m in mass) / 3,
        "rollout_corr/support_size_mean": sum(sizes) / 3,
        "rollout_corr/support_size_p50": sizes[1],
        "rollout_corr/support_size_p99": p99,
        "rollout_corr/support_singleton_fraction": sum(len(k) == 1 for k in kept) / 3,
        "rollout_corr/support_miss_fraction": 1 / 3,
    }, rel=1e-12)


def test_replay_of_the_hand_kept_sets_gives_the_same_score():
    hidden, weight, ids, mask = _constructed_batch()
    _, kept = HAND["top_p"]
    dense = torch.zeros(3, 6, dtype=torch.bool)
    for i, k in enumerate(kept):
        dense[i, k] = True
    steps = [S.compact_kept(dense[i:i + 1]) for i in range(3)]
    row = S.kept_tokens_from_steps(steps, 0, 3, 6)
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.8})
    replay = S.SupportScorer(spec, "replay").score(hidden, weight, None, ids, mask, 3, kept=[row])
    recompute = S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, 3)
    for a, b in zip(replay, recompute):
        torch.testing.assert_close(a, b)


def test_one_token_support_gives_ratio_one_and_zero_gradient():
    hidden, weight, ids, mask = _constructed_batch()
    hidden.requires_grad_(True)
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.8})
    score = S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, 3)
    assert score.size[0, 1] == 1 and score.log_probs[0, 1] == 0.0
    (grad,) = torch.autograd.grad(score.log_probs[0, 1], hidden)
    assert torch.count_nonzero(grad) == 0


# ------------------------------------------------------------------------------ the engines' processors
def _random_batch(seed=0, b=3, prompt=4, completion=7, vocab=40, hidden_size=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 3
    hidden = torch.randn(b, prompt + completion, hidden_size, generator=g, dtype=dtype)
    ids = torch.randint(0, vocab, (b, prompt + completion), generator=g)
    # every other completion token is the argmax (kept by any truncation), the others random (often misses)
    argmax = (hidden[:, prompt - 1:-1] @ weight.t()).argmax(-1)
    ids[:, prompt::2] = argmax[:, ::2]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, prompt + 5:] = 0  # a row that ended early
    return hidden, weight, ids, mask, completion


TRANSFORMERS_CASES = [
    dict(top_p=0.8), dict(top_k=20), dict(min_p=0.1), dict(temperature=0.7, top_p=0.9),
    dict(repetition_penalty=1.3, temperature=1.2, top_k=15, top_p=0.85, min_p=0.05), dict(repetition_penalty=0.8),
]


def _transformers_processors(params):
    """(value processors, set processors) as transformers builds them, in its order."""
    values, sets = LogitsProcessorList(), LogitsProcessorList()
    if "repetition_penalty" in params:
        values.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    if "temperature" in params:
        values.append(TemperatureLogitsWarper(params["temperature"]))
    if "top_k" in params:
        sets.append(TopKLogitsWarper(params["top_k"]))
    if "top_p" in params:
        sets.append(TopPLogitsWarper(params["top_p"]))
    if "min_p" in params:
        sets.append(MinPLogitsWarper(params["min_p"]))
    return values, sets


@pytest.mark.parametrize("params", TRANSFORMERS_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_recompute_equals_transformers_processors(params):
    """Per position, transformers' own processors on the generate input (padded prompt + completion so far) give
    the same kept set, kept mass and log-prob of every kept sampled token."""
    hidden, weight, ids, mask, T = _random_batch()
    spec = S.sampler_from_generation_config({"do_sample": True, **params})
    score = S.SupportScorer(spec, "recompute", chunk_elements=40 * 4).score(hidden, weight, None, ids, mask, T)
    (values, sets), P, checked = _transformers_processors(params), ids.size(1) - T, 0
    for r in range(ids.size(0)):
        for s in range(T):
            if not mask[r, P + s]:
                assert score.size[r, s] == 0 and score.log_probs[r, s] == 0
                continue
            history = ids[r:r + 1, :P + s]
            processed = values(history, (hidden[r, P + s - 1] @ weight.t()).unsqueeze(0))
            scores = sets(history, processed.clone())[0]
            kept = torch.isfinite(scores)
            assert score.size[r, s] == kept.sum(), (r, s)
            torch.testing.assert_close(score.log_mass[r, s],
                                       torch.logsumexp(scores, -1) - torch.logsumexp(processed[0], -1))
            a = ids[r, P + s]
            assert bool(score.miss[r, s]) == (not kept[a])
            if kept[a]:
                checked += 1
                torch.testing.assert_close(score.log_probs[r, s], torch.log_softmax(scores, -1)[a])
    assert checked > 0


def test_vllm_order_differs_from_transformers_for_min_p_with_top_p():
    """p = (.45, .25, .2, .1), min_p .3 (keeps p >= .135), top_p .75 (drops ascending cumulative mass <= .25).
    transformers, top-p then min-p: top-p drops .1 (cum .1; .3 > .25), min-p keeps the rest: 3 tokens.
    vLLM, min-p then top-p: min-p drops .1, top-p on the renormalised (.5, .278, .222) drops .2 (cum .222): 2."""
    logits = torch.tensor([[0.45, 0.25, 0.2, 0.1]], dtype=torch.float64).log()
    hidden, ids = torch.cat([logits, logits]).unsqueeze(0), torch.tensor([[0, 0]])
    params = dict(top_p=0.75, min_p=0.3)
    hf = S.sampler_from_generation_config({"do_sample": True, **params})
    vllm = S.sampler_from_vllm_params(params)
    assert [p.name for p in hf.steps] == ["top_p", "min_p"] and [p.name for p in vllm.steps] == ["min_p", "top_p"]
    sizes = [S.SupportScorer(spec, "recompute").score(hidden, torch.eye(4, dtype=torch.float64), None, ids,
                                                       torch.ones_like(ids), 1).size.item() for spec in (hf, vllm)]
    assert sizes == [3, 2]


@pytest.mark.parametrize("engine,params", [
    ("transformers", dict(temperature=0.7, top_p=0.8)),
    ("transformers", dict(top_k=5, repetition_penalty=1.4)),
    ("vllm", dict(min_p=0.1, temperature=1.3, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3,
                  presence_penalty=0.2)),
])
@pytest.mark.parametrize("mode", ["recompute", "replay"])
def test_gradient_through_the_normaliser_matches_finite_differences(engine, params, mode):
    hidden, weight, ids, mask, T = _random_batch(b=2, prompt=3, completion=5, vocab=30, hidden_size=8)
    bias = torch.randn(30, dtype=torch.float64)
    spec = (S.sampler_from_generation_config({"do_sample": True, **params}) if engine == "transformers"
            else S.sampler_from_vllm_params(params))
    kept = None
    if mode == "replay":  # random kept sets: some hold the sampled token, some do not (misses)
        g = torch.Generator().manual_seed(1)
        kept = []
        for r in range(ids.size(0)):
            n = int(mask[r, -T:].sum())
            dense = torch.rand(n, 30, generator=g) < 0.3
            kept.append(S.kept_tokens_from_steps([S.compact_kept(dense[s:s + 1]) for s in range(n)], 0, n, 30))
    scorer = S.SupportScorer(spec, mode, chunk_elements=30 * 3)

    def f(h, w, bb):
        return scorer.score(h, w, bb, ids, mask, T, kept=kept).log_probs

    inputs = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ the sampler contract
def test_transformers_contract_order_sources_and_unsupported():
    config = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
              "repetition_penalty": 1.1, "no_repeat_ngram_size": 3, "suppress_tokens": [5]}
    spec = S.sampler_from_generation_config(
        config, sources={"top_p": "RolloutCorrGRPOConfig.top_p", "temperature": "generation_kwargs"},
        trainer_temperature=1.0)
    assert [(p.name, p.value) for p in spec.steps] == [
        ("repetition_penalty", 1.1), ("temperature", 0.7), ("top_k", 20), ("top_p", 0.9), ("min_p", 0.05)]
    unsupported = [(p.name, p.kind) for p in spec.unsupported]
    assert unsupported == [("no_repeat_ngram_size", "set"), ("suppress_tokens", "set")]
    assert spec.truncates and spec.temperature == 0.7
    report = spec.report("off")
    assert report[0].startswith("temperature=0.7 (generation_kwargs) shapes mu")
    assert any(line.startswith("top_p=0.9 (RolloutCorrGRPOConfig.top_p)") and "kept mass" in line for line in report)
    assert any(line.startswith("no_repeat_ngram_size=3 (generation_config.json)") for line in report)
    assert len(report) == 1 + 5 - 1 + 2  # temperature mismatch, 4 other steps, 2 unsupported
    recompute_report = [line.split(" ")[0] for line in spec.report("recompute")]
    assert recompute_report == ["no_repeat_ngram_size=3", "suppress_tokens=[5]"]
    assert spec.report("replay") == []  # both are set processors: the kept sets cover them
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size=3.*replay"):
        spec.check("recompute")
    spec.check("replay")
    spec.check("off")


def test_transformers_contract_neutral_values_and_errors():
    spec = S.sampler_from_generation_config({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                             "min_p": 0.0, "repetition_penalty": 1.0, "typical_p": 1.0})
    assert spec.steps == () and spec.unsupported == () and not spec.truncates
    assert spec.report("off") == []
    with pytest.raises(ValueError, match="do_sample=True"):
        S.sampler_from_generation_config({"do_sample": False})
    with pytest.raises(ValueError, match="rollout_support_matching must be one of"):
        spec.report("sometimes")


def test_matches_trl_scoring_only_without_any_processor_beyond_the_trainer_temperature():
    """Support matching is a no-op (the trainer warns once) exactly when the sampler applies nothing TRL's head does
    not: no truncation, no penalty, the trainer's temperature."""
    neutral = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert S.sampler_from_generation_config(neutral, trainer_temperature=0.7).matches_trl_scoring
    assert S.sampler_from_vllm_params({"temperature": 0.7, "top_k": -1, "top_p": 1.0, "min_p": 0.0},
                                      trainer_temperature=0.7).matches_trl_scoring
    changed = [
        (dict(neutral, top_p=0.9), 0.7),                 # truncation
        (dict(neutral, top_k=20), 0.7),
        (dict(neutral, repetition_penalty=1.1), 0.7),    # nothing truncated, but a penalty matching reproduces
        (dict(neutral, no_repeat_ngram_size=2), 0.7),    # a set processor replay covers
        (neutral, 1.0),                                  # the engine's temperature is not the trainer's
    ]
    for config, trainer_temperature in changed:
        spec = S.sampler_from_generation_config(config, trainer_temperature=trainer_temperature)
        assert not spec.matches_trl_scoring, config


def test_vllm_contract_order_and_unknown_fields():
    params = {"n": 1, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.2,
              "presence_penalty": 0.5, "frequency_penalty": 0.0, "max_tokens": 32, "logprobs": 0,
              "logit_bias": {3: 1.0}, "bad_words": ["x"], "my_new_knob": 1}
    spec = S.sampler_from_vllm_params(params, sources={"logit_bias": "generation_kwargs"})
    assert [p.name for p in spec.steps] == ["repetition_penalty", "presence_penalty", "temperature", "min_p",
                                            "top_k", "top_p"]
    assert [(p.name, p.kind, p.source) for p in spec.unsupported] == [
        ("bad_words", "set", "SamplingParams"), ("logit_bias", "value", "generation_kwargs"),
        ("my_new_knob", "value", "SamplingParams")]
    with pytest.raises(ValueError, match="logit_bias"):
        spec.check("replay")  # a value processor: replaying the kept set does not reproduce it
    with pytest.raises(ValueError, match="greedy"):
        S.sampler_from_vllm_params({"temperature": 0.0})


def test_check_transformers_processors_names_disagreements():
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.9, "temperature": 0.7})
    good = [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9), MinPLogitsWarper(0.0)]
    assert S.check_transformers_processors(spec, good) == []
    bad = [TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.9), NoRepeatNGramLogitsProcessor(2)]
    problems = S.check_transformers_processors(spec, bad)
    assert any("NoRepeatNGramLogitsProcessor" in p for p in problems)
    assert any("temperature" in p and "0.5" in p for p in problems)


def test_renormalize_logits_last_is_not_a_disagreement():
    """Issue 22: ``renormalize_logits=True`` appends ``LogitNormalization`` (a log-softmax: one constant per
    position) after every processor; it changes neither the distribution nor mu, so it is accepted where it stands,
    and reported anywhere else (a repetition penalty after it, sign-dependent, would see other logits)."""
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.9, "temperature": 0.7,
                                             "renormalize_logits": True})
    assert spec.unsupported == () and [p.name for p in spec.steps] == ["temperature", "top_p"]
    good = [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9), LogitNormalization()]
    assert S.check_transformers_processors(spec, good) == []
    early = [LogitNormalization(), TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]
    assert S.check_transformers_processors(spec, early) == [
        "generate applied LogitNormalization, which the sampler contract does not list"]


# ------------------------------------------------------------------------------ kept-token sets and metrics
def test_compact_kept_round_trip_and_size():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    steps, dense = [], []
    for _ in range(5):
        kept = torch.rand(3, vocab, generator=g) < torch.tensor([[0.1], [0.9], [1.0]])
        dense.append(kept)
        steps.append(S.compact_kept(kept))
    for row in range(3):
        tokens = S.kept_tokens_from_steps(steps, row, 4, vocab)
        expected = torch.stack([d[row] for d in dense[:4]])
        assert torch.equal(tokens.mask(), expected)
        assert tokens.sizes().tolist() == expected.sum(1).tolist()
        # never more ids than min(|K|, V - |K|) per position
        assert tokens.token_ids.numel() == sum(min(int(k), vocab - int(k)) for k in expected.sum(1))
    assert S.kept_tokens_from_steps(steps, 2, 4, vocab).token_ids.numel() == 0  # untruncated rows cost nothing
    with pytest.raises(ValueError, match="Row 1: 6 tokens but only 5"):
        S.kept_tokens_from_steps(steps, 1, 6, vocab)


def test_support_stats_merge_equals_one_pass():
    hidden, weight, ids, mask, T = _random_batch(seed=5, b=4)
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.7})
    scorer = S.SupportScorer(spec, "recompute")
    whole = S.SupportStats.from_score(scorer.score(hidden, weight, None, ids, mask, T), mask[:, -T:])
    parts = [S.SupportStats.from_score(scorer.score(hidden[i:i + 2], weight, None, ids[i:i + 2], mask[i:i + 2], T),
                                       mask[i:i + 2, -T:]) for i in (0, 2)]
    merged = parts[0].merge(parts[1])
    assert merged.finalize() == pytest.approx(whole.finalize(), rel=1e-12)
    # two ranks (threads): sums added, sizes exact (a small window) or counted; either equals one pass
    from thread_ranks import run_ranks

    for exact_max in (None, 0):
        whole = S.SupportStats.from_score(scorer.score(hidden, weight, None, ids, mask, T), mask[:, -T:],
                                          exact_max=exact_max)
        reduced = run_ranks(2, lambda rank, reducers: S.SupportStats.from_score(
            scorer.score(hidden[2 * rank:2 * rank + 2], weight, None, ids[2 * rank:2 * rank + 2],
                         mask[2 * rank:2 * rank + 2], T), mask[2 * rank:2 * rank + 2, -T:],
            exact_max=exact_max).reduce(reducers).finalize())
        assert reduced[0] == reduced[1] == pytest.approx(whole.finalize(), rel=1e-12)
    empty = S.SupportStats.from_score(scorer.score(hidden, weight, None, ids, mask, T), torch.zeros_like(mask[:, -T:]))
    assert empty.finalize() == {}  # no token: no statistic (never 0)


def test_invalidate_misses_and_input_errors():
    lp = torch.tensor([[-1.0, -2.0]])
    assert S.invalidate_misses(lp, None) is lp and S.invalidate_misses(lp, torch.zeros(1, 2, dtype=torch.bool)) is lp
    out = S.invalidate_misses(lp, torch.tensor([[False, True]]))
    assert out[0, 0] == -1.0 and math.isnan(out[0, 1])
    hidden, weight, ids, mask, T = _random_batch()
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.7})
    with pytest.raises(ValueError, match="kept-token sets for every row"):
        S.SupportScorer(spec, "replay").score(hidden, weight, None, ids, mask, T)
    short = S.kept_tokens_from_steps([S.compact_kept(torch.ones(1, 40, dtype=torch.bool))] * 2, 0, 2, 40)
    with pytest.raises(ValueError, match="Row 0: 2 kept-token sets for a completion of 7 tokens"):
        S.SupportScorer(spec, "replay").score(hidden, weight, None, ids, mask, T, kept=[short] * 3)
    with pytest.raises(ValueError, match="do not describe one"):
        S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, ids.size(1))
    with pytest.raises(ValueError, match="'recompute' or 'replay'"):
        S.SupportScorer(spec, "off")


def test_chunking_does_not_change_the_result():
    hidden, weight, ids, mask, T = _random_batch(seed=7)
    spec = S.sampler_from_generation_config({"do_sample": True, "top_k": 9, "top_p": 0.9, "repetition_penalty": 1.2})
    one = S.SupportScorer(spec, "recompute", chunk_elements=1).score(hidden, weight, None, ids, mask, T)
    big = S.SupportScorer(spec, "recompute", chunk_elements=10**9).score(hidden, weight, None, ids, mask, T)
    for a, b in zip(one, big):
        torch.testing.assert_close(a, b)


BACKWARD_CASES = [
    ("vllm", dict(top_p=0.9), "recompute"),
    ("transformers", dict(top_k=5), "recompute"),
    ("transformers", dict(top_p=0.9, temperature=0.7), "recompute"),
    ("transformers", dict(repetition_penalty=1.3, top_p=0.9), "recompute"),
    ("vllm", dict(repetition_penalty=1.3, frequency_penalty=0.2, temperature=0.7, top_k=5), "recompute"),
    ("vllm", dict(top_p=0.9), "replay"),
]


@pytest.mark.parametrize("engine,params,mode", BACKWARD_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saved_softmax_backward_is_bit_identical_to_the_recompute_backward(engine, params, mode, dtype, monkeypatch):
    """Within ``SAVED_SOFTMAX_ELEMENTS`` the backward reuses the forward's softmax over K ∪ {a}; at budget 0 it
    recomputes the chunk's logits: same ops on the same values, so log-probs and all three gradients are equal
    bit for bit (torch.equal), over several chunks, misses included. The count of value-processor calls shows
    which path ran (once per chunk when saved, twice when recomputed)."""
    from trl_rollout_corr.support import scorer as scorer_module

    hidden, weight, ids, mask, T = _random_batch(seed=3, b=4, prompt=4, completion=9, vocab=50, dtype=dtype)
    bias = torch.randn(50, dtype=dtype, generator=torch.Generator().manual_seed(4))
    spec = (S.sampler_from_generation_config({"do_sample": True, **params}) if engine == "transformers"
            else S.sampler_from_vllm_params(params))
    kept = None
    if mode == "replay":
        g = torch.Generator().manual_seed(5)
        kept = [S.kept_tokens_from_steps([S.compact_kept(torch.rand(1, 50, generator=g) < 0.3) for _ in range(n)],
                                         0, n, 50) for n in mask[:, -T:].sum(dim=1).tolist()]
    calls = []
    processed = scorer_module._ChunkPlan.processed
    monkeypatch.setattr(scorer_module._ChunkPlan, "processed",
                        lambda self, z, sl: (calls.append(sl), processed(self, z, sl))[1])

    def run(budget):
        monkeypatch.setattr(scorer_module, "SAVED_SOFTMAX_ELEMENTS", budget)
        inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        calls.clear()
        score = S.SupportScorer(spec, mode, chunk_elements=50 * 7).score(*inputs, ids, mask, T, kept=kept)
        weights = torch.randn(score.log_probs.shape, dtype=dtype, generator=torch.Generator().manual_seed(6))
        (score.log_probs * weights).sum().backward()
        return score, [t.grad for t in inputs], len(calls)

    saved_score, saved_grads, saved_calls = run(scorer_module.SAVED_SOFTMAX_ELEMENTS)
    recomputed_score, recomputed_grads, recomputed_calls = run(0)
    n_chunks = math.ceil(int(mask[:, -T:].sum()) / 7)
    assert (saved_calls, recomputed_calls) == (n_chunks, 2 * n_chunks) and n_chunks > 1
    assert bool(saved_score.miss.any()) and bool((saved_score.valid & ~saved_score.miss).any())
    assert torch.equal(saved_score.log_probs, recomputed_score.log_probs)
    for a, b in zip(saved_grads, recomputed_grads):
        assert torch.count_nonzero(a) > 0 and torch.equal(a, b)


def test_saved_softmax_is_not_kept_without_grad():
    """Under no_grad (the pi_old forward) or for inputs without grad, the forward saves no softmax."""
    from trl_rollout_corr.support import scorer as scorer_module

    hidden, weight, ids, mask, T = _random_batch(seed=8)
    spec = S.sampler_from_vllm_params({"top_p": 0.9})
    seen = []
    forward = scorer_module._SupportLogProbs.forward

    def spy(ctx, *args):
        out = forward(ctx, *args)
        seen.append(ctx.saved_softmax is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scorer_module._SupportLogProbs, "forward", staticmethod(spy))
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.no_grad():
            S.SupportScorer(spec, "recompute").score(h, w, None, ids, mask, T)
        S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, T)
        S.SupportScorer(spec, "recompute").score(h, w, None, ids, mask, T)
    assert seen == [False, False, True]


def test_accumulator_flushes_support_metrics_per_mode():
    from trl_rollout_corr.accumulator import RolloutCorrAccumulator

    hidden, weight, ids, mask, T = _random_batch(seed=2)
    spec = S.sampler_from_generation_config({"do_sample": True, "top_k": 7})
    stats = S.SupportStats.from_score(S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, T),
                                      mask[:, -T:])
    acc = RolloutCorrAccumulator()
    acc.add_support("eval", stats)
    acc.add_support("eval", stats)
    flushed = acc.flush("eval")
    assert flushed == {f"eval_{k}": v for k, v in stats.finalize().items()}  # merging equal parts keeps the means
    assert flushed["eval_rollout_corr/support_size_p50"] == 7.0
    assert acc.flush("eval") == {} and acc.flush("train") == {}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_entropy_is_the_full_vocabulary_entropy_at_the_trainer_temperature(temperature):
    """``entropy_temperature``: -sum q log q of softmax(z / t) over all of V (no engine processor), by hand."""
    spec = S.sampler_from_generation_config({"do_sample": True, "top_p": 0.8, "repetition_penalty": 1.3})
    hidden, weight, ids, mask = _constructed_batch()
    expected = []
    for p in PROBS:  # z = log p: softmax(z / t) is p^(1/t), normalised
        q = [v ** (1 / temperature) for v in p]
        q = [v / sum(q) for v in q]
        expected.append(-sum(v * math.log(v) for v in q))
    for chunk in (1, 10**9):
        score = S.SupportScorer(spec, "recompute", chunk_elements=chunk).score(
            hidden, weight, None, ids, mask, 3, entropy_temperature=temperature)
        torch.testing.assert_close(score.entropy[0], torch.tensor(expected, dtype=torch.float64))
        assert not score.entropy.requires_grad
    plain = S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, 3)
    assert plain.entropy is None
    torch.testing.assert_close(plain.log_probs, score.log_probs)  # the support log-probs do not change
    assert S.SupportScore.cat([plain, plain]).entropy is None
    assert S.SupportScore.cat([score, score]).entropy.shape == (2, 3)
    with pytest.raises(ValueError, match="entropy_temperature must be > 0"):
        S.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, 3, entropy_temperature=0.0)
