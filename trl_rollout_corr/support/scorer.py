"""``SupportScorer``: the chunked log-probs over the trainer's support (``support``)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from .contract import SamplerSpec
from .kept import KeptTokens, kept_mask

# Default work-chunk size of the support computation, in logits (positions x vocabulary): 2**22 float32 = 16 MiB
# per (chunk, V) buffer; a chunk holds about six of them at its peak (see benchmarks/RESULTS.md).
DEFAULT_CHUNK_ELEMENTS = 2**22
# Budget of the softmax ``_SupportLogProbs`` saves for its backward, in elements (N positions x V, twice that with a
# repetition penalty, whose dz'/dz is saved too): 2**26 float32 = 256 MiB. Within it the backward reuses the forward's
# softmax over ``K ∪ {a}`` instead of recomputing the chunk's logits; above it (or at 0) it recomputes them.
SAVED_SOFTMAX_ELEMENTS = 2**26


# ====================================================================================== the support computation
class SupportScore(NamedTuple):
    """Per-token result of ``SupportScorer.score`` over ``(b, T)`` completion positions.

    Attributes:
        log_probs: (b, T) ``log pi(a) = z'_a - logsumexp_{K ∪ {a}} z'`` in nats, differentiable w.r.t. the hidden
            states and the LM head; 0 where ``valid`` is False. For a missed token (``a`` outside ``K``) the set is
            extended by ``a``, so the value stays finite (the caller makes the token invalid).
        log_mass: (b, T) ``log S = logsumexp_K z' - logsumexp_V z'`` (nats, <= 0), detached; 0 where not valid.
        size: (b, T) int64 ``|K|``; 0 where not valid.
        miss: (b, T) bool, the sampled token is outside ``K`` (never where not valid).
        valid: (b, T) bool, the positions scored (the completion mask).
        entropy: (b, T) entropy (nats) of the full-vocabulary softmax of ``z / temperature`` (the raw logits, no
            engine processor: what TRL's fused LM head reports with ``compute_entropy``), detached; 0 where not
            valid. None unless ``score`` was given ``entropy_temperature``.
    """

    log_probs: torch.Tensor
    log_mass: torch.Tensor
    size: torch.Tensor
    miss: torch.Tensor
    valid: torch.Tensor
    entropy: Optional[torch.Tensor] = None

    @staticmethod
    def cat(scores: Sequence["SupportScore"]) -> "SupportScore":
        """Concatenate row chunks (dim 0)."""
        return SupportScore(*(None if any(p is None for p in parts) else torch.cat(parts, dim=0)
                              for parts in zip(*scores)))


class SupportScorer:
    """Scores completion tokens with the engine's processors applied to the trainer's logits.

    Args:
        spec: the sampler contract.
        mode: ``"recompute"`` (``K`` from the trainer's logits with ``spec``'s set processors in the engine's order)
            or ``"replay"`` (``K`` is the engine's kept set, given per row to ``score``).
        chunk_elements: positions per work chunk times V (the peak working memory is a few ``(chunk, V)``
            buffers, float32 unless the inputs are float64). With a gradient wanted and N positions x V within
            ``SAVED_SOFTMAX_ELEMENTS`` (2**26; 2 N x V counted with a repetition penalty), the softmax over the
            support is also kept from the forward to the backward: N x V x 4 bytes at float32 (<= 256 MiB).

    Raises:
        ValueError: an unknown mode.

    Semantics, per position (row r, completion step s; the token at prompt width P + s):

    * value processors in the engine's order: repetition penalty ``rp`` on every token already seen (transformers:
      every id of the generate input up to the position, left padding included; vLLM: the prompt's real tokens and
      the completion so far), ``z < 0 -> z * rp`` else ``z / rp`` (transformers) / ``z > 0 -> z * (1 / rp)`` else
      ``z * rp`` (vLLM); vLLM's frequency and presence penalties subtract ``f * count`` and ``p * [count > 0]`` over
      the completion so far; temperature divides;
    * set processors (recompute) in the engine's order, each on the scores the previous ones left: top-k keeps the
      k largest (ties kept), top-p keeps the tokens whose ascending cumulative softmax exceeds ``1 - p`` (and the
      largest), min-p keeps ``p_v >= min_p * max p``. Every kept set is ``{v : z'_v >= t}`` for one threshold t,
      so tokens tied with the last kept one are kept (an engine's sort may split such exact ties);
    * ``log pi(a) = z'_a - logsumexp_{K ∪ {a}} z'``; its gradient w.r.t. ``z'`` is ``onehot(a) - q`` with ``q`` the
      softmax over ``K ∪ {a}`` (zero for a one-token support), times the value processors' derivative.
    """

    def __init__(self, spec: SamplerSpec, mode: str, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        if mode not in ("recompute", "replay"):
            raise ValueError(f"SupportScorer mode must be 'recompute' or 'replay', got {mode!r}.")
        self.spec, self.mode, self.chunk_elements = spec, mode, int(chunk_elements)

    def score(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        kept: Optional[Sequence[KeptTokens]] = None,
        entropy_temperature: Optional[float] = None,
    ) -> SupportScore:
        """Support-matched log-probs of the completion tokens of a prompt + completion batch.

        Args:
            hidden: (b, L, H) the backbone's last hidden states (the LM head's input), with grad if wanted.
            weight: (V, H) the LM head weight; bias: (V,) or None.
            input_ids: (b, L) prompt (left-padded, width ``P = L - T``) then completion ids.
            attention_mask: (b, L) 0/1; its completion part ``[:, P:]`` is the completion mask.
            logits_to_keep: T, the completion width.
            kept: replay only: ``b`` kept-token sets, ``len(kept[i])`` = row i's completion length.
            entropy_temperature: also compute ``SupportScore.entropy`` at this temperature (TRL's
                ``GRPOConfig.temperature``), from the logits this pass computes anyway, so that a caller needing
                TRL's entropies does not run TRL's LM head as well (``trl_compat.skip_fused_lm_head``).

        Returns:
            ``SupportScore`` of shape (b, T).

        Raises:
            ValueError: mismatched shapes, replay without ``kept`` or with a row whose length differs from its
                completion mask (naming the row), a temperature that is not positive.
        """
        b, length = input_ids.shape
        T = int(logits_to_keep)
        if hidden.shape[:2] != (b, length) or attention_mask.shape != (b, length) or not 0 < T < length:
            raise ValueError(
                f"SupportScorer.score: hidden {tuple(hidden.shape)}, input_ids {tuple(input_ids.shape)}, "
                f"attention_mask {tuple(attention_mask.shape)} and logits_to_keep {T} do not describe one (b, P + T) "
                "batch."
            )
        if entropy_temperature is not None and not entropy_temperature > 0:
            raise ValueError(f"SupportScorer.score: entropy_temperature must be > 0, got {entropy_temperature}.")
        P = length - T
        valid = attention_mask[:, P:] != 0
        rows, steps = valid.nonzero(as_tuple=True)
        plan = _ChunkPlan(self, input_ids, attention_mask, P, rows, steps, weight.size(0), kept)
        plan.entropy_temperature = entropy_temperature
        h = hidden[rows, P - 1 + steps]
        logp, log_mass, size, miss, entropy = _SupportLogProbs.apply(h, weight, bias, plan)
        parts = (log_mass, size, miss) + ((entropy,) if entropy_temperature is not None else ())
        out = [torch.zeros(b, T, dtype=t.dtype, device=t.device) for t in (logp, *parts)]
        out[0] = out[0].index_put((rows, steps), logp)  # out of place: keeps the graph to the hidden states
        for full, part in zip(out[1:], parts):
            full[rows, steps] = part
        return SupportScore(out[0], out[1], out[2], out[3], valid, out[4] if entropy_temperature is not None else None)


class _ChunkPlan:
    """Everything ``_SupportLogProbs`` needs per chunk of positions: labels, value processors, kept sets."""

    def __init__(self, scorer: SupportScorer, input_ids, attention_mask, P, rows, steps, vocab, kept) -> None:
        spec = scorer.spec
        self.spec, self.mode, self.vocab = spec, scorer.mode, vocab
        self.rows, self.steps, self.P = rows, steps, P
        self.labels = input_ids[rows, P + steps]
        self.chunk = max(1, scorer.chunk_elements // max(vocab, 1))
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.entropy_temperature: Optional[float] = None  # SupportScorer.score sets it to compute the entropies
        self.grad_enabled = torch.is_grad_enabled()  # the caller's grad mode (off inside an autograd forward)
        self.kept = None
        if self.mode == "replay":
            self.kept = self._replay_rows(kept, attention_mask[:, P:] != 0)

    def _replay_rows(self, kept, valid):
        if kept is None:
            raise ValueError("rollout_support_matching='replay' needs the engine's kept-token sets for every row.")
        if len(kept) != valid.size(0):
            raise ValueError(f"{len(kept)} kept-token sets for {valid.size(0)} rows.")
        lengths = valid.sum(dim=1).tolist()
        for row, (k, n) in enumerate(zip(kept, lengths)):
            if len(k) != n or not bool(valid[row, :n].all()):
                raise ValueError(
                    f"Row {row}: {len(k)} kept-token sets for a completion of {n} tokens (or a completion mask with "
                    "holes); the replayed support would be misaligned."
                )
        return kept

    def chunks(self) -> Iterator[slice]:
        n = self.labels.numel()
        for start in range(0, n, self.chunk):
            yield slice(start, min(start + self.chunk, n))

    # ---------------------------------------------------------------- value processors
    def processed(self, z: torch.Tensor, sl: slice) -> tuple[torch.Tensor, Any]:
        """z' (in place on ``z``) and dz'/dz (a (n, V) tensor, or a float) for the chunk's raw logits ``z``."""
        scale: Any = 1.0
        seen = counts = None
        for p in self.spec.value_steps:
            if p.name == "repetition_penalty":
                seen = self._seen(sl) if seen is None else seen
                if self.spec.engine == "vllm":  # vLLM: logits *= where(logits > 0, 1 / rp, rp) on seen tokens
                    factor = torch.where(z > 0, 1.0 / p.value, p.value)
                    factor = torch.where(seen, factor, 1.0).to(z.dtype)
                    z.mul_(factor)
                else:  # transformers: where(score < 0, score * rp, score / rp) on seen tokens
                    factor = torch.where(seen, torch.where(z < 0, p.value, 1.0 / p.value), 1.0).to(z.dtype)
                    z.copy_(torch.where(seen, torch.where(z < 0, z * p.value, z / p.value), z))
                scale = factor * scale
            elif p.name in ("frequency_penalty", "presence_penalty"):
                counts = self._completion_counts(sl) if counts is None else counts
                z.sub_(p.value * (counts if p.name == "frequency_penalty" else (counts > 0).to(z.dtype)))
            elif p.name == "temperature":
                z.div_(p.value)
                scale = scale / p.value
        return z, scale

    def _seen(self, sl: slice) -> torch.Tensor:
        """(n, V) bool: the ids the engine's repetition penalty counts as seen at each position of the chunk."""
        rows, steps = self.rows[sl], self.steps[sl]
        ids = self.input_ids[rows].clamp(max=self.vocab)
        width = torch.arange(ids.size(1), device=ids.device)
        allowed = width.unsqueeze(0) < (self.P + steps).unsqueeze(1)
        if self.spec.engine == "vllm":  # the prompt's real tokens only, not the left padding
            allowed &= self.attention_mask[rows] != 0
        ids = torch.where(allowed, ids, self.vocab)
        seen = torch.zeros(ids.size(0), self.vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids, True)[:, : self.vocab]

    def _completion_counts(self, sl: slice) -> torch.Tensor:
        """(n, V) float: occurrences of each id in the completion before each position of the chunk."""
        rows, steps = self.rows[sl], self.steps[sl]
        ids = self.input_ids[rows, self.P:].clamp(max=self.vocab)
        allowed = torch.arange(ids.size(1), device=ids.device).unsqueeze(0) < steps.unsqueeze(1)
        ids = torch.where(allowed, ids, self.vocab)
        counts = torch.zeros(ids.size(0), self.vocab + 1, dtype=torch.float32, device=ids.device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, : self.vocab]

    # ---------------------------------------------------------------- kept sets
    def support(self, y: torch.Tensor, sl: slice, threshold: Optional[torch.Tensor] = None):
        """(kept (n, V) bool, threshold (n,) or None) for processed logits ``y``; pass the forward's threshold in the
        backward to skip the sort."""
        if self.mode == "replay":
            chunk_rows, chunk_steps = self.rows[sl], self.steps[sl]
            groups = torch.unique_consecutive(chunk_rows, return_counts=True)
            parts, start = [], 0
            for row, count in zip(groups[0].tolist(), groups[1].tolist()):
                parts.append((self.kept[row], chunk_steps[start:start + count]))
                start += count
            return kept_mask([k for k, _ in parts], [s for _, s in parts], self.vocab, y.device), None
        if threshold is None:
            threshold = recompute_threshold(y, self.spec)
        return y >= threshold.unsqueeze(1), threshold


def recompute_threshold(y: torch.Tensor, spec: SamplerSpec) -> torch.Tensor:
    """The kept-set threshold of ``spec``'s set processors, in the engine's order, on processed logits ``y``.

    Args:
        y: (n, V) processed logits (after the value processors).
        spec: the sampler contract.

    Returns:
        (n,) t such that the kept set is ``{v : y_v >= t}`` (``-inf``: everything kept).
    """
    n, vocab = y.shape
    t = y.new_full((n,), -math.inf)
    for p in spec.set_steps:
        cur = y if p is spec.set_steps[0] else y.masked_fill(y < t.unsqueeze(1), -math.inf)
        if p.name == "top_k":
            k = min(int(p.value), vocab)
            if k < vocab:
                t = torch.maximum(t, cur.topk(k, dim=-1).values[:, -1])
        elif p.name == "top_p":
            t = torch.maximum(t, _top_p_threshold(cur, float(p.value)))
        elif p.name == "min_p":
            probs = cur.softmax(dim=-1)
            removed = probs < p.value * probs.amax(dim=-1, keepdim=True)
            t = torch.maximum(t, cur.masked_fill(removed, math.inf).amin(dim=-1))
            del probs, removed
    return t


def _top_p_threshold(scores: torch.Tensor, top_p: float, first_k: int = 256) -> torch.Tensor:
    """(n,) the smallest score top-p keeps: the engines drop a token when the ascending cumulative softmax up to
    it is ``<= 1 - top_p``, i.e. when the mass strictly above it is ``>= top_p`` (the largest is always kept).

    Computed from the ``k`` largest scores (``topk``: 10-30x cheaper than a full sort of a 49k vocabulary), ``k``
    quadrupled for the rows whose kept set does not fit, and one full sort for the rows left once ``k`` passes
    V / 16 (near-uniform distributions); the cumulative mass in float64.
    """
    n, vocab = scores.shape
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.empty(n, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(n, device=scores.device)
    k = min(first_k, vocab)
    while rows.numel():
        if k > vocab // 16:
            k = vocab
        values = scores[rows].sort(dim=-1, descending=True).values if k == vocab else scores[rows].topk(k).values
        probs = (values - lse[rows]).double().exp()
        above = probs.cumsum(dim=-1) - probs  # mass strictly above each of the k largest
        kept = (above < top_p).sum(dim=-1).clamp(min=1)
        done = (kept < k) | (k == vocab)
        out[rows[done]] = values[done].gather(1, (kept[done] - 1).unsqueeze(1)).squeeze(1)
        rows, k = rows[~done], 4 * k
    return out


class _SupportLogProbs(torch.autograd.Function):
    """``log pi(a)`` over ``K ∪ {a}`` per position, chunked over positions.

    forward(hidden (N, H), weight (V, H), bias (V,) or None, plan) -> (log_probs (N,), log_mass (N,), size (N,),
    miss (N,), entropy (N,): the full-vocabulary entropy at ``plan.entropy_temperature``, or (0,) when it is None);
    only ``log_probs`` is differentiable. Saved for the backward: the inputs, the (N,) thresholds (recompute) and the
    (N,) outputs; and, when a gradient is wanted and ``N x V`` (``2 N x V`` with a repetition penalty) fits
    ``SAVED_SOFTMAX_ELEMENTS`` (2**26: 256 MiB at float32, i.e. ``N x V x 4`` bytes, 8 at float64), each chunk's
    softmax ``q`` over ``K ∪ {a}`` (and dz'/dz where it is a tensor), so that the backward skips the recompute
    (the logits matmul, the value processors, the kept set and the softmax). Above the budget the backward
    recomputes all of that per chunk and no (N, V) tensor is held; both paths give bit-identical gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan: _ChunkPlan):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n_pos, device = hidden.size(0), hidden.device
        log_probs = torch.empty(n_pos, dtype=dtype, device=device)
        log_mass = torch.empty(n_pos, dtype=dtype, device=device)
        size = torch.empty(n_pos, dtype=torch.int64, device=device)
        miss = torch.empty(n_pos, dtype=torch.bool, device=device)
        thresholds = torch.full((n_pos,), -math.inf, dtype=dtype, device=device)
        entropy_t = plan.entropy_temperature
        entropy = torch.empty(n_pos if entropy_t is not None else 0, dtype=dtype, device=device)
        per_position = 2 if any(p.name == "repetition_penalty" for p in plan.spec.value_steps) else 1
        keep_softmax = (plan.grad_enabled and any(ctx.needs_input_grad[:3])
                        and n_pos * plan.vocab * per_position <= SAVED_SOFTMAX_ELEMENTS)
        saved = [] if keep_softmax else None
        for sl in plan.chunks():
            z = _logits(hidden[sl], weight, bias, dtype)
            if entropy_t is not None:
                entropy[sl] = _entropy(z, entropy_t)
            y, scale = plan.processed(z, sl)
            kept, t = plan.support(y, sl)
            if t is not None:
                thresholds[sl] = t
            label = plan.labels[sl].unsqueeze(1)
            hit = kept.gather(1, label).squeeze(1)
            y_label = y.gather(1, label).squeeze(1)
            lse_all = torch.logsumexp(y, dim=-1)
            size[sl] = kept.sum(dim=1)
            lse_kept = torch.logsumexp(y.masked_fill_(~kept, -math.inf), dim=-1)
            lse_scored = torch.where(hit, lse_kept, torch.logaddexp(lse_kept, y_label))
            log_probs[sl] = y_label - lse_scored
            log_mass[sl] = lse_kept - lse_all
            miss[sl] = ~hit
            if saved is not None:  # the backward's softmax, on the same values: y on K ∪ {a}, -inf elsewhere
                y.scatter_(1, label, y_label.unsqueeze(1))  # y is -inf off K already; put back a missed label's z'
                saved.append((torch.softmax(y, dim=-1), scale))
            del z, y, kept
        ctx.save_for_backward(hidden, weight, bias, thresholds)
        ctx.plan, ctx.dtype, ctx.saved_softmax = plan, dtype, saved
        ctx.mark_non_differentiable(log_mass, size, miss, entropy)
        return log_probs, log_mass, size, miss, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, *_):
        hidden, weight, bias, thresholds = ctx.saved_tensors
        plan, dtype, saved = ctx.plan, ctx.dtype, ctx.saved_softmax
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        for i, sl in enumerate(plan.chunks()):
            h = hidden[sl].to(dtype)
            label = plan.labels[sl].unsqueeze(1)
            g = grad_log_probs[sl].to(dtype).unsqueeze(1)
            if saved is not None:
                q, scale = saved[i]
                grad = q.mul(-g)  # out of place: the saved q serves a second backward (retain_graph)
            else:
                y, scale = plan.processed(_logits(h, weight, bias, dtype), sl)
                kept, _ = plan.support(y, sl, thresholds[sl])
                kept.scatter_(1, label, True)  # K ∪ {a}
                grad = torch.softmax(y.masked_fill_(~kept, -math.inf), dim=-1).mul_(-g)
            grad.scatter_add_(1, label, g)  # g * (onehot(a) - q)
            grad = grad.mul_(scale) if torch.is_tensor(scale) else grad.mul_(float(scale))
            if grad_h is not None:
                grad_h[sl] = grad @ weight.to(dtype)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(dim=0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(grad_h, hidden), cast(grad_w, weight), None if bias is None else cast(grad_b, bias), None


def _entropy(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) entropy (nats) of ``softmax(z / temperature)`` over the last dim of the (n, V) logits ``z``, as TRL's
    chunked head: ``log Z - sum_v e^{x_v} x_v / Z`` with ``x = z * (1 / temperature)``."""
    x = z * (1.0 / temperature)
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    p = torch.exp(x - log_z)
    return log_z.squeeze(-1) - torch.linalg.vecdot(p, x)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    z = h.to(dtype) @ weight.to(dtype).t()
    return z if bias is None else z.add_(bias.to(dtype))


@contextlib.contextmanager
def capture_module_outputs(module: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[list]:
    """Within the block, every forward of ``module`` appends ``fn(args, kwargs, output)`` to the yielded list.

    A forward hook (``register_forward_hook(with_kwargs=True)``), removed on exit, also on error. It runs inside the
    module's caller's forward, so it sees the tensors as the caller does (with their autograd graph).
    """
    results: list = []
    handle = module.register_forward_hook(lambda _m, args, kwargs, output: results.append(fn(args, kwargs, output)),
                                          with_kwargs=True)
    try:
        yield results
    finally:
        handle.remove()
