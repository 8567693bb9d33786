"""``trl-rollout-corr probe``: measure the engine/trainer log-prob mismatch on a model before training.

1. Sample completions with the rollout engine (``--engine vllm``: ``engines.vllm_cpu.build_cpu_llm`` with an explicit
   dtype and ``processed_logprobs``; ``--engine transformers``: ``transformers.generate`` with
   ``engines.transformers_generate.capture_generate_log_probs``, in ``--rollout-dtype`` through
   ``generate_in_dtype``), recording log mu of every sampled token.
2. Score the same tokens with the training forward, TRL 1.16's own (``trl_compat.add_training_lm_head`` /
   ``training_log_probs``: the fused, chunked LM head at the sampling temperature, prompts left-padded and
   completions right-padded as TRL lays them out), with the weights in ``--train-dtype``, at ``--train-batch-size``
   rows per forward and again at one row per forward (the trainer's self-consistency: bf16 kernels are not
   batch-invariant, verl#6280).
3. Report ``l = log pi_train - log mu`` per token: quantiles, mean and max |l|, the fraction of tokens whose ratio
   leaves each ``--band``, by completion position and by completion length, the most mismatched tokens in context;
   with truncated sampling (top-p < 1, top-k > 0, min-p > 0) the truncation term ``log S`` (the kept mass,
   recomputed from the trainer's logits with the engine's processors in the engine's order) and the ratio after
   support matching; and the float32-LM-head variants where the engine allows it (trainer side: TRL's
   ``cast_lm_head_to_fp32``; vLLM side: ``hf_overrides={"head_dtype": "float32"}``).

Writes ``report.json`` and PNG figures (``plotting.probe_figures``) into ``--out``; ``--fail-above X`` makes the
command exit 1 when ``--fail-metric`` exceeds X. Nothing is downloaded: ``--model`` is a local folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_BANDS = ("0.9_1.1", "0.8_1.25", "0.5_2.0")
POSITION_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LENGTH_EDGES = (8, 16, 32, 64, 128, 256, 512, 1024)
FAIL_METRICS = {
    "mean_abs": "mean |log ratio| (nats)",
    "p99_abs": "p99 of |log ratio| (nats)",
    "max_abs": "max |log ratio| (nats)",
    "out_of_band": "fraction of tokens whose ratio is outside the first --band",
    "self_consistency_max_abs": "max |log pi(batch 1) - log pi(batch B)| (nats)",
}
REPORT = "report.json"
OUTPUTS = (REPORT, "probe_log_ratio.png", "probe_by_position.png", "probe_self_consistency.png")
DEFAULT_PROMPTS = (
    "What is 17 + 25? Answer with the number.",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "Explain what a prime number is in one sentence.",
    "Translate 'good morning' into French.",
    "List the first five even numbers.",
    "What is the capital of Japan?",
    "Give a synonym for 'happy'.",
    "Write a haiku about autumn.",
    "How many legs does a spider have?",
    "What is 9 times 7?",
    "Describe a cat in five words.",
    "Which planet is closest to the sun?",
    "Write a Python expression that adds 2 and 3.",
    "What colour do you get by mixing blue and yellow?",
    "Complete the sequence: 2, 4, 8, 16, ...",
)


class ProbeError(ValueError):
    """Bad probe input (prompts file, flags, model folder); the message names the file or flag and the fix."""


@dataclass
class Sample:
    """One sampled completion: prompt and completion ids, log mu per completion token (nats)."""

    prompt: int
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_log_probs: list[float]
    scores: dict[str, list[float]] = field(default_factory=dict)  # variant -> log pi_train per token


# ---------------------------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``probe`` flags."""
    p.add_argument("--model", required=True, metavar="PATH", help="local model folder (weights and tokenizer)")
    p.add_argument("--engine", required=True, choices=("vllm", "transformers"),
                   help="rollout engine: vllm (vLLM CPU, in process) or transformers (transformers.generate)")
    p.add_argument("--rollout-dtype", required=True, choices=tuple(DTYPES), help="the engine's weights dtype")
    p.add_argument("--train-dtype", required=True, choices=tuple(DTYPES), help="the training forward's weights dtype")
    p.add_argument("--prompts", metavar="FILE",
                   help="prompts: .jsonl with 'prompt' (text) or 'messages' (chat) per line, or one prompt per line "
                        "(default: 16 built-in short prompts)")
    p.add_argument("--num-prompts", type=int, default=16, help="use the first N prompts (default 16)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="max completion tokens (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (default 0.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as plain text")
    p.add_argument("--train-batch-size", type=int, default=8,
                   help="rows per training forward; self-consistency compares batch 1 with this (default 8)")
    p.add_argument("--no-fp32-lm-head", action="store_true", help="skip the float32-LM-head variants")
    p.add_argument("--band", action="append", metavar="L_U",
                   help=f"ratio band for the out-of-band fractions, repeatable (default {', '.join(DEFAULT_BANDS)})")
    p.add_argument("--top-tokens", type=int, default=10, help="most mismatched tokens to show (default 10)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM max_model_len (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--fail-above", type=float, metavar="X", help="exit 1 when --fail-metric exceeds X")
    p.add_argument("--fail-metric", choices=tuple(FAIL_METRICS), default="mean_abs",
                   help="statistic --fail-above tests: " + "; ".join(f"{k}: {v}" for k, v in FAIL_METRICS.items()))
    p.add_argument("--out", metavar="DIR", help="output folder (default probe-ENGINE-ROLLOUT-TRAIN)")
    p.add_argument("--overwrite", action="store_true", help="replace existing report/plots in --out")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures (no matplotlib needed)")


def parse_band(text: str) -> tuple[float, float]:
    """``"L_U"`` -> (L, U) with 0 < L <= U (ratio units).

    Raises:
        ProbeError: for anything else.
    """
    try:
        lo, hi = (float(x) for x in text.split("_"))
    except ValueError as e:
        raise ProbeError(f"--band {text!r}: expected L_U, e.g. 0.9_1.1.") from e
    if not 0 < lo <= hi:
        raise ProbeError(f"--band {text!r}: need 0 < L <= U.")
    return lo, hi


def _check_args(args: argparse.Namespace) -> None:
    if not Path(args.model, "config.json").is_file():
        raise ProbeError(f"--model {args.model}: no config.json there; pass a local model folder (nothing is "
                         "downloaded).")
    for flag, value, ok in (("--num-prompts", args.num_prompts, args.num_prompts >= 1),
                            ("--samples-per-prompt", args.samples_per_prompt, args.samples_per_prompt >= 1),
                            ("--max-tokens", args.max_tokens, args.max_tokens >= 1),
                            ("--train-batch-size", args.train_batch_size, args.train_batch_size >= 1),
                            ("--temperature", args.temperature, args.temperature > 0),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1),
                            ("--top-k", args.top_k, args.top_k >= 0),
                            ("--min-p", args.min_p, 0 <= args.min_p < 1)):
        if not ok:
            raise ProbeError(f"{flag} {value!r} is out of range.")
    top = getattr(args, "top_tokens", 0)
    if top < 0:
        raise ProbeError(f"--top-tokens {top}: the number of most mismatched tokens to show must be >= 0 (0: none).")
    fail_above = getattr(args, "fail_above", None)
    if fail_above is not None and not math.isfinite(fail_above):
        raise ProbeError(f"--fail-above {fail_above}: a CI gate needs a finite threshold (nan never fails, inf never "
                         "fails); give a number, e.g. --fail-above 0.05, or drop the flag.")


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(path: Optional[str], limit: int) -> list[Any]:
    """Prompts from a file (``.jsonl``: ``{"prompt": str}`` or ``{"messages": [...]}`` per line; otherwise one
    prompt per non-empty line) or the built-in ones; at most ``limit``.

    Raises:
        ProbeError: a missing or empty file, or a JSONL line that is not such an object (names the line).
    """
    if path is None:
        return list(DEFAULT_PROMPTS[:limit])
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ProbeError(f"--prompts {p}: cannot read it ({e.strerror}).") from e
    prompts: list[Any] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                item = json.loads(line)
                prompt = item["messages"] if "messages" in item else item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ProbeError(f"{p}:{lineno}: expected a JSON object with 'prompt' (text) or 'messages' (a chat "
                                 f"list) ({e}).") from e
            prompts.append(prompt)
        else:
            prompts.append(line.strip())
        if len(prompts) == limit:
            break
    if not prompts:
        raise ProbeError(f"--prompts {p}: no prompt in the file.")
    return prompts


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Any], chat_template: bool) -> list[list[int]]:
    """Prompt token ids: the chat template with the generation prompt when the tokenizer has one (and
    ``chat_template``), else the plain text."""
    out = []
    for prompt in prompts:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if chat_template and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        out.append([int(t) for t in ids])
    return out


# ---------------------------------------------------------------------------------------------- sampling
def sample_vllm(args: argparse.Namespace, prompt_ids: list[list[int]], *, fp32_head: bool = False) -> list[Sample]:
    """Sample with vLLM CPU (``build_cpu_llm``: explicit dtype, processed log-probs); ``fp32_head`` runs vLLM's
    LM head in float32 (``hf_overrides={"head_dtype": "float32"}``)."""
    from vllm import SamplingParams

    from .engines.vllm_cpu import build_cpu_llm, sampled_log_probs_batch

    extra = {"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}
    llm = build_cpu_llm(args.model, args.rollout_dtype, max_model_len=args.max_model_len, seed=args.seed, **extra)
    params = SamplingParams(n=args.samples_per_prompt, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens, logprobs=0,
                            seed=args.seed)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    samples = []
    for k, out in enumerate(outputs):
        completions = list(out.outputs)
        for c, lps in zip(completions, sampled_log_probs_batch(completions)):
            samples.append(Sample(k, list(prompt_ids[k]), list(c.token_ids), lps))
    del llm, outputs
    gc.collect()
    return samples


def sample_transformers(args: argparse.Namespace, prompt_ids: list[list[int]], tokenizer: Any) -> list[Sample]:
    """Sample with ``transformers.generate`` from a ``--rollout-dtype`` copy of the float32 weights, recording the
    processed log-probs (``capture_generate_log_probs``); one generate call per prompt."""
    from transformers import AutoModelForCausalLM

    from .engines.transformers_generate import capture_generate_log_probs, generate_in_dtype

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = _eos_ids(model, tokenizer)
    torch.manual_seed(args.seed)
    samples = []
    for k, ids in enumerate(prompt_ids):
        input_ids = torch.tensor([ids] * args.samples_per_prompt)
        with torch.no_grad(), generate_in_dtype(model, args.rollout_dtype), capture_generate_log_probs(model) as cap:
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None,
                                 min_p=args.min_p or None, max_new_tokens=args.max_tokens,
                                 pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0])
        completions = [_cut_at_eos(row[len(ids):].tolist(), eos) for row in out]
        for completion, lps in zip(completions, cap.completion_log_probs(completions)):
            samples.append(Sample(k, list(ids), completion, lps))
    del model
    gc.collect()
    return samples


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def _cut_at_eos(ids: list[int], eos: Sequence[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


# ---------------------------------------------------------------------------------------------- scoring
def trl_layout(samples: Sequence[Sample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, P + T) input ids and attention mask as TRL lays out a batch (prompts left-padded, completions
    right-padded), and T."""
    P = max(len(s.prompt_ids) for s in samples)
    T = max(len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), P + T), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, P - p:P] = torch.tensor(s.prompt_ids)
        ids[i, P:P + c] = torch.tensor(s.completion_ids)
        mask[i, P - p:P + c] = 1
    return ids, mask, T


def score(model: Any, samples: Sequence[Sample], batch_size: int, pad_token_id: int) -> list[list[float]]:
    """log pi_train of every completion token with TRL's training forward, ``batch_size`` samples per forward
    (consecutive samples, in order). Returns one list per sample, nats."""
    from .trl_compat import training_log_probs

    out: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            chunk = [s for s in samples[start:start + batch_size]]
            ids, mask, T = trl_layout(chunk, pad_token_id)
            logps = training_log_probs(model, ids, mask, T).float()
            out.extend(logps[i, :len(s.completion_ids)].tolist() for i, s in enumerate(chunk))
    return out


def kept_support(logits: torch.Tensor, *, top_k: int, top_p: float, min_p: float, order: str) -> torch.Tensor:
    """The tokens the sampler keeps, per position, from temperature-scaled logits.

    Args:
        logits: (N, V) float32 logits already divided by the temperature.
        top_k, top_p, min_p: the sampling processors (0, 1.0, 0.0 = off).
        order: ``"vllm"`` (min-p, then top-k, then top-p: vLLM V1's sampler) or ``"transformers"`` (top-k, top-p,
            then min-p: generate's warper order).

    Returns:
        (N, V) bool. Each filter acts on the distribution renormalised over what the previous ones kept, as both
        engines do; top-p keeps the smallest set whose mass reaches p (the token that crosses p is kept); every
        filter keeps at least the most probable token. Ties at the top-k threshold are all kept.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)

    def renormalised() -> torch.Tensor:
        p = torch.where(keep, probs, 0.0)
        return p / p.sum(-1, keepdim=True)

    for name in ("min_p", "top_k", "top_p") if order == "vllm" else ("top_k", "top_p", "min_p"):
        if name == "min_p" and min_p > 0:
            p = renormalised()
            keep = keep & (p >= min_p * p.amax(-1, keepdim=True))
        elif name == "top_k" and 0 < top_k < probs.shape[-1]:
            q = torch.where(keep, probs, -1.0)
            keep = keep & (q >= q.topk(top_k, dim=-1).values[:, -1:])
        elif name == "top_p" and top_p < 1.0:
            sorted_p, idx = renormalised().sort(dim=-1, descending=True)
            keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the mass before the token is below p
            keep_sorted[:, 0] = True
            keep = keep & torch.zeros_like(keep).scatter(-1, idx, keep_sorted)
    return keep


def truncation_terms(model: Any, samples: Sequence[Sample], args: argparse.Namespace, pad_token_id: int,
                     order: str) -> tuple[list[list[float]], list[list[bool]]]:
    """Per token: log S (nats) of the trainer's own temperature-scaled distribution under the engine's processors
    (``kept_support``), and whether the sampled token is inside that recomputed support (``False``: a support miss,
    spec section 8). The trainer's plain (unfused) forward gives the logits, in ``--train-dtype``."""
    log_mass: list[list[float]] = []
    inside: list[list[bool]] = []
    with torch.no_grad():
        for start in range(0, len(samples), args.train_batch_size):
            chunk = list(samples[start:start + args.train_batch_size])
            ids, mask, T = trl_layout(chunk, pad_token_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1].float() / args.temperature
            for i, s in enumerate(chunk):
                row = logits[i, :len(s.completion_ids)]
                keep = kept_support(row, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, order=order)
                probs = torch.softmax(row, dim=-1)
                log_mass.append(torch.log(torch.where(keep, probs, 0.0).sum(-1)).tolist())
                inside.append(keep.gather(-1, torch.tensor(s.completion_ids).unsqueeze(-1)).squeeze(-1).tolist())
    return log_mass, inside


# ---------------------------------------------------------------------------------------------- statistics
QUANTILES = (0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999)


def log_ratio_stats(log_ratio: torch.Tensor, bands: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Distribution of per-token log ratios ``l`` (nats).

    Args:
        log_ratio: (N,) float, e.g. log pi_train - log mu over the sampled tokens (finite values only are used).
        bands: ratio bands (L, U); ``out_of_band[f"{L}_{U}"]`` is the fraction of tokens with exp(l) outside.

    Returns:
        ``tokens``, ``mean``, ``std``, ``mean_abs``, ``max_abs``, ``mean_ratio`` (mean of exp(l)), quantiles of l
        (``q0.001`` ... ``q0.999``), of |l| (``p50_abs``, ``p90_abs``, ``p99_abs``), ``out_of_band``,
        ``non_finite`` (count of NaN/inf entries left out). All 0 for no token.
    """
    x = log_ratio.double().reshape(-1)
    finite = torch.isfinite(x)
    x = x[finite]
    out: dict[str, Any] = {"tokens": int(x.numel()), "non_finite": int((~finite).sum())}
    if x.numel() == 0:
        out.update(mean=0.0, std=0.0, mean_abs=0.0, max_abs=0.0, mean_ratio=0.0, p50_abs=0.0, p90_abs=0.0,
                   p99_abs=0.0, **{f"q{q:g}": 0.0 for q in QUANTILES}, out_of_band={f"{lo:g}_{hi:g}": 0.0
                                                                                    for lo, hi in bands})
        return out
    a = x.abs()
    qs = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64))
    aqs = torch.quantile(a, torch.tensor((0.5, 0.9, 0.99), dtype=torch.float64))
    out.update(mean=float(x.mean()), std=float(x.std(unbiased=False)), mean_abs=float(a.mean()),
               max_abs=float(a.max()), mean_ratio=float(torch.exp(x.clamp(-20, 20)).mean()),
               p50_abs=float(aqs[0]), p90_abs=float(aqs[1]), p99_abs=float(aqs[2]),
               **{f"q{q:g}": float(v) for q, v in zip(QUANTILES, qs)})
    out["out_of_band"] = {f"{lo:g}_{hi:g}": float(((x < math.log(lo)) | (x > math.log(hi))).double().mean())
                          for lo, hi in bands}
    return out


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """``[lo, hi)`` labels for integer buckets with these edges (the first starts at 0, the last is open)."""
    bounds = (0, *edges)
    labels = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(bounds, bounds[1:])]
    return labels + [f">={edges[-1]}"]


def by_bucket(values: torch.Tensor, keys: torch.Tensor, edges: Sequence[int],
              band: tuple[float, float]) -> list[dict[str, Any]]:
    """Per integer bucket of ``keys`` (positions or lengths): tokens, mean l, mean/p50/p99/max |l|, out-of-band
    fraction for ``band``. Empty buckets are left out."""
    idx = torch.bucketize(keys, torch.tensor(list(edges)), right=True)
    rows = []
    for j, label in enumerate(bucket_labels(edges)):
        sel = values[idx == j]
        if not sel.numel():
            continue
        s = log_ratio_stats(sel, [band])
        rows.append({"bucket": label, "tokens": s["tokens"], "mean": s["mean"], "mean_abs": s["mean_abs"],
                     "p50_abs": s["p50_abs"], "p99_abs": s["p99_abs"], "max_abs": s["max_abs"],
                     "out_of_band": next(iter(s["out_of_band"].values()))})
    return rows


def flat(samples: Sequence[Sample], variant: str, *, minus: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Per token over all samples: ``l`` = scores[variant] - (scores[minus] or log mu), its position and the
    completion length."""
    ls, pos, lengths = [], [], []
    for s in samples:
        a = torch.tensor(s.scores[variant], dtype=torch.float64)
        b = torch.tensor(s.scores[minus] if minus else s.rollout_log_probs, dtype=torch.float64)
        ls.append(a - b)
        pos.append(torch.arange(len(s.completion_ids)))
        lengths.append(torch.full((len(s.completion_ids),), len(s.completion_ids)))
    def cat(xs, dtype):
        return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)

    return {"l": cat(ls, torch.float64), "position": cat(pos, torch.int64), "length": cat(lengths, torch.int64)}


def top_tokens(samples: Sequence[Sample], variant: str, tokenizer: Any, k: int) -> list[dict[str, Any]]:
    """The ``k`` tokens with the largest |log pi_train - log mu|, each with its context (12 tokens before, 4 after)."""
    items = []
    for i, s in enumerate(samples):
        for t, (lp, mu) in enumerate(zip(s.scores[variant], s.rollout_log_probs)):
            if math.isfinite(lp) and math.isfinite(mu):
                items.append((abs(lp - mu), i, t, lp, mu))
    items.sort(reverse=True)
    out = []
    for _, i, t, lp, mu in items[:k]:
        ids = samples[i].completion_ids
        out.append({
            "sample": i, "position": t, "token_id": ids[t], "token": tokenizer.decode([ids[t]]),
            "context": tokenizer.decode(ids[max(0, t - 12):t]) + " [[" + tokenizer.decode([ids[t]]) + "]] "
            + tokenizer.decode(ids[t + 1:t + 5]),
            "log_pi_train": lp, "log_mu": mu, "log_ratio": lp - mu, "pi_train": math.exp(lp), "mu": math.exp(mu),
        })
    return out


# ---------------------------------------------------------------------------------------------- the run
def _load_trainer_model(path: str, dtype: str, temperature: float, fp32_head: bool):
    from transformers import AutoModelForCausalLM

    from .trl_compat import add_training_lm_head

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    add_training_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=fp32_head)
    return model


def run(args: argparse.Namespace, say=print) -> tuple[dict[str, Any], list[Sample], dict[str, list[float]]]:
    """Sample, score and measure (see the module docstring). Returns (report, samples, histogram series)."""
    from transformers import AutoTokenizer

    _check_args(args)
    bands = [parse_band(b) for b in (args.band or DEFAULT_BANDS)]
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(args.prompts, args.num_prompts)
    prompt_ids = tokenize_prompts(tokenizer, prompts, not args.no_chat_template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    say(f"[probe] sampling {len(prompt_ids)} prompts x {args.samples_per_prompt} with {args.engine} "
        f"({args.rollout_dtype})")
    if args.engine == "vllm":
        samples = sample_vllm(args, prompt_ids)
    else:
        samples = sample_transformers(args, prompt_ids, tokenizer)
    timings["sample_s"] = time.perf_counter() - t0
    samples = [s for s in samples if s.completion_ids]
    if not samples:
        raise ProbeError("The engine produced no completion token; raise --max-tokens.")
    t0 = time.perf_counter()
    say(f"[probe] scoring {len(samples)} completions with the training forward ({args.train_dtype}), batch "
        f"{args.train_batch_size} and batch 1")
    model = _load_trainer_model(args.model, args.train_dtype, args.temperature, fp32_head=False)
    truncation = _score_train(model, samples, args, pad)
    timings["score_s"] = time.perf_counter() - t0
    fp32_head, fp32_samples = {}, None
    if not args.no_fp32_lm_head:
        fp32_head, fp32_samples = _fp32_lm_head(args, samples, prompt_ids, pad, say, timings)
    del model
    gc.collect()
    return _report(args, bands, samples, fp32_samples, tokenizer, truncation, fp32_head, timings)


def _score_train(model, samples: list[Sample], args: argparse.Namespace, pad: int) -> Optional[dict[str, Any]]:
    """The training forward's scores of every sample (batch ``--train-batch-size`` and batch 1), and with a
    truncating sampler the support-matched scores; returns the truncation summary (None without truncation)."""
    for s, lp in zip(samples, score(model, samples, args.train_batch_size, pad)):
        s.scores["train"] = lp
    for s, lp in zip(samples, score(model, samples, 1, pad)):
        s.scores["train_batch1"] = lp
    if not (args.top_p < 1.0 or args.top_k > 0 or args.min_p > 0):
        return None
    order = "vllm" if args.engine == "vllm" else "transformers"
    log_mass, inside = truncation_terms(model, samples, args, pad, order)
    for s, lm in zip(samples, log_mass):
        s.scores["train_support_matched"] = [a - m for a, m in zip(s.scores["train"], lm)]
    masses = torch.tensor([m for row in log_mass for m in row], dtype=torch.float64)
    misses = sum(not x for row in inside for x in row)
    return {"processor_order": order, "log_kept_mass_mean": float(masses.mean()),
            "log_kept_mass_min": float(masses.min()), "kept_mass_mean": float(masses.exp().mean()),
            "support_miss_tokens": misses}


def _fp32_lm_head(args: argparse.Namespace, samples: list[Sample], prompt_ids, pad: int, say,
                  timings: dict[str, float]) -> tuple[dict[str, Any], Optional[list[Sample]]]:
    """The float32-LM-head variants: the trainer's (TRL's ``cast_lm_head_to_fp32``) and, with vLLM, the engine's
    (resampled). Returns (what was measured, the resampled samples or None)."""
    fp32_head: dict[str, Any] = {}
    fp32_samples = None
    if args.train_dtype == "float32":
        fp32_head["train"] = "n/a: the training forward is float32 already"
    else:
        model = _load_trainer_model(args.model, args.train_dtype, args.temperature, fp32_head=True)
        for s, lp in zip(samples, score(model, samples, args.train_batch_size, pad)):
            s.scores["train_fp32_head"] = lp
        fp32_head["train"] = "measured (variant train_fp32_head: TRL's cast_lm_head_to_fp32)"
    if args.rollout_dtype == "float32":
        fp32_head["rollout"] = "n/a: the engine is float32 already"
    elif args.engine != "vllm":
        fp32_head["rollout"] = "n/a: transformers.generate runs the LM head in the model dtype"
    else:
        say("[probe] sampling again with vLLM's LM head in float32 (hf_overrides head_dtype=float32)")
        t0 = time.perf_counter()
        fp32_samples = [s for s in sample_vllm(args, prompt_ids, fp32_head=True) if s.completion_ids]
        model = _load_trainer_model(args.model, args.train_dtype, args.temperature, fp32_head=False)
        for s, lp in zip(fp32_samples, score(model, fp32_samples, args.train_batch_size, pad)):
            s.scores["train"] = lp
        timings["rollout_fp32_head_s"] = time.perf_counter() - t0
        fp32_head["rollout"] = "measured (variant rollout_fp32_head: vLLM head_dtype=float32, resampled)"
    return fp32_head, fp32_samples


def _report(args, bands, samples, fp32_samples, tokenizer, truncation, fp32_head, timings):
    """The report, the samples and the histogram series of ``run``."""
    band = bands[0]
    main = flat(samples, "train")
    variants = {"engine_vs_train": log_ratio_stats(main["l"], bands)}
    series = {f"{args.engine} {args.rollout_dtype} vs train {args.train_dtype}": main["l"].tolist()}
    if truncation is not None:
        matched = flat(samples, "train_support_matched")["l"]
        variants["engine_vs_train_support_matched"] = log_ratio_stats(matched, bands)
        series["support matched (trainer log p_T - log S)"] = matched.tolist()
    if "train_fp32_head" in samples[0].scores:
        lf = flat(samples, "train_fp32_head")["l"]
        variants["engine_vs_train_fp32_head"] = log_ratio_stats(lf, bands)
        series[f"{args.engine} {args.rollout_dtype} vs train {args.train_dtype} with float32 LM head"] = lf.tolist()
    if fp32_head.get("rollout", "").startswith("measured"):
        lr = flat(fp32_samples, "train")["l"]
        variants["engine_fp32_head_vs_train"] = log_ratio_stats(lr, bands)
        series[f"{args.engine} {args.rollout_dtype} with float32 LM head (resampled) vs train {args.train_dtype}"] = \
            lr.tolist()
    sc = flat(samples, "train_batch1", minus="train")["l"]
    report = {
        "identity": identity(args), "tokens": int(main["l"].numel()), "samples": len(samples),
        "log_ratio": variants["engine_vs_train"], "variants": variants,
        "by_position": by_bucket(main["l"], main["position"], POSITION_EDGES, band),
        "by_length": by_bucket(main["l"], main["length"], LENGTH_EDGES, band),
        "top_tokens": top_tokens(samples, "train", tokenizer, args.top_tokens),
        "self_consistency": {"batch_size": args.train_batch_size, "dtype": args.train_dtype,
                             **log_ratio_stats(sc, bands),
                             "exactly_equal_fraction": float((sc == 0).double().mean()) if sc.numel() else 0.0},
        "truncation": truncation, "fp32_lm_head": fp32_head, "timings_s": timings,
    }
    return report, samples, {"series": series, "self_consistency": sc.tolist()}


def identity(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers describe: model, engine, dtypes, sampling; printed on every figure."""
    return {"model": str(args.model), "engine": args.engine, "rollout dtype": args.rollout_dtype,
            "train dtype": args.train_dtype, "train batch": args.train_batch_size,
            "sampling": f"T={args.temperature:g} top_p={args.top_p:g} top_k={args.top_k} min_p={args.min_p:g} "
                        f"max_tokens={args.max_tokens}", "seed": args.seed}


def fail_value(report: dict[str, Any], metric: str) -> float:
    """The statistic ``--fail-above`` tests (see ``FAIL_METRICS``)."""
    stats = report["self_consistency" if metric == "self_consistency_max_abs" else "log_ratio"]
    return float(next(iter(stats["out_of_band"].values())) if metric == "out_of_band" else
                 stats["max_abs" if metric == "self_consistency_max_abs" else metric])


def gate(report: dict[str, Any], metric: str, threshold: float) -> tuple[dict[str, Any], str]:
    """``--fail-above``: (the report's ``fail`` entry, one line of text). Fails when the statistic exceeds
    ``threshold``, is itself non-finite, or its statistics left non-finite log ratios out (``non_finite``: a NaN or
    inf token is the worst mismatch, never a pass)."""
    value = fail_value(report, metric)
    left_out = int(report["self_consistency" if metric == "self_consistency_max_abs" else "log_ratio"].get(
        "non_finite", 0))
    failed = not math.isfinite(value) or left_out > 0 or value > threshold
    why = f" and {left_out} non-finite log ratio(s) left out of it" if left_out else ""
    return ({"metric": metric, "value": value, "threshold": threshold, "non_finite": left_out, "failed": failed},
            f"{FAIL_METRICS[metric]} = {value:.4g}{why} vs {threshold:g}: {'FAIL' if failed else 'ok'}")


def print_report(report: dict[str, Any], say=print) -> None:
    """The report as text."""
    from .console import format_table

    idn = report["identity"]
    say(f"\nProbe: {idn['model']} | {idn['engine']} {idn['rollout dtype']} vs train {idn['train dtype']} | "
        f"{report['samples']} completions, {report['tokens']} tokens | {idn['sampling']}")
    header = ["variant", "tokens", "mean l", "mean |l|", "p99 |l|", "max |l|", "mean ratio",
              *[f"out [{b.replace('_', ', ')}]" for b in report["log_ratio"]["out_of_band"]]]
    rows = [[name, str(s["tokens"]), f"{s['mean']:.2e}", f"{s['mean_abs']:.2e}", f"{s['p99_abs']:.2e}",
             f"{s['max_abs']:.2e}", f"{s['mean_ratio']:.4f}", *[f"{100 * v:.2f}%" for v in s["out_of_band"].values()]]
            for name, s in report["variants"].items()]
    sc = report["self_consistency"]
    rows.append([f"self-consistency (batch 1 vs {sc['batch_size']}, {sc['dtype']})", str(sc["tokens"]),
                 f"{sc['mean']:.2e}", f"{sc['mean_abs']:.2e}", f"{sc['p99_abs']:.2e}", f"{sc['max_abs']:.2e}",
                 f"{sc['mean_ratio']:.4f}", *[f"{100 * v:.2f}%" for v in sc["out_of_band"].values()]])
    say("l = log pi_train - log mu (nats); self-consistency: l = log pi(batch 1) - log pi(batch B)")
    say(format_table(header, rows))
    say(f"  self-consistency: {100 * sc['exactly_equal_fraction']:.1f}% of tokens bit-identical")
    if report["truncation"]:
        t = report["truncation"]
        say(f"Truncation term: mean log S {t['log_kept_mass_mean']:.4f} nats (kept mass {t['kept_mass_mean']:.4f}), "
            f"min {t['log_kept_mass_min']:.3f}; {t['support_miss_tokens']} sampled tokens outside the trainer's "
            f"recomputed support ({t['processor_order']} processor order)")
    for side, text in report["fp32_lm_head"].items():
        say(f"float32 LM head, {side} side: {text}")
    for by in ("position", "length"):
        say(f"\nBy completion {by}:")
        say(format_table([by, "tokens", "mean l", "mean |l|", "p99 |l|", "max |l|", "out of band"],
                         [[r["bucket"], str(r["tokens"]), f"{r['mean']:.2e}", f"{r['mean_abs']:.2e}",
                           f"{r['p99_abs']:.2e}", f"{r['max_abs']:.2e}", f"{100 * r['out_of_band']:.2f}%"]
                          for r in report[f"by_{by}"]]))
    say("\nMost mismatched tokens (context [[token]] next):")
    for t in report["top_tokens"]:
        say(f"  l={t['log_ratio']:+.3e}  mu={t['mu']:.4g} pi_train={t['pi_train']:.4g}  sample {t['sample']} "
            f"pos {t['position']}: {t['context']!r}")


def main(args: argparse.Namespace) -> int:
    """The ``probe`` sub-command. Returns 0, or 1 when ``--fail-above`` is exceeded."""
    from .console import EXIT_CHECK_FAILED, EXIT_OK, check_outputs

    out = Path(args.out or f"probe-{args.engine}-{args.rollout_dtype}-{args.train_dtype}")
    if not args.no_plots:
        from .plotting import require_matplotlib

        require_matplotlib()
    _check_args(args)
    check_outputs(out, OUTPUTS, args.overwrite)
    report, samples, series = run(args)
    print_report(report)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / REPORT]
    if not args.no_plots:
        from .plotting import probe_figures

        written += probe_figures(report, series["series"], series["self_consistency"], out, report["identity"])
    status = EXIT_OK
    if args.fail_above is not None:
        report["fail"], text = gate(report, args.fail_metric, args.fail_above)
        print(f"\n--fail-above: {text}")
        status = EXIT_CHECK_FAILED if report["fail"]["failed"] else EXIT_OK
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    print("Wrote " + ", ".join(str(p) for p in written))
    return status
