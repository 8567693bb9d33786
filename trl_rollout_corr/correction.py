"""Rollout correction: importance-sampling (IS) weights and rejection-sampling (RS) masks.

Pure functions on ``(B, T)`` tensors; nothing here knows TRL or ``torch.distributed`` (a cross-rank sum is
passed in as a callable). The behaviour is specified in the project's ``ROLLOUT_CORRECTION.md`` and follows
verl's ``algorithm.rollout_correction`` (0.9.x) except where that spec marks a deliberate difference:

* k1 rejection bands keep the ratio band the user wrote (verl keeps ``[1/U, 1/L]``);
* rows without a valid token are never counted in per-sequence metrics (verl averages them in);
* NaN/inf log-probs at valid tokens make the token invalid (removed from the mask, weight 1, counted),
  instead of propagating NaN into weights, metrics and gradients;
* an all-zero IcePop batch gives ESS 0 instead of a ``ZeroDivisionError``;
* an empty batch (no valid token) is not an error: weights/mask are returned, metrics are 0 with counts.

Sources: truncated IS (TIS) from Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025); IcePop from the Ring-1T report (2025); k1/k2/k3 estimators from J. Schulman,
"Approximating KL Divergence" (2020); the mode split (decoupled/bypass) from verl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .config import RolloutCorrectionConfig, RSSpec
from .engines.alignment import check_aligned
from .metrics import CorrectionStats

SAFETY_BOUND = 20.0  # |log ratio| clamp before exponentiation, in nats (as verl)
DEFAULT_LENGTH_BUCKETS = (64, 256, 1024)  # response-length slice edges, in valid tokens per row
AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RolloutCorrectionOutput:
    """Result of ``compute_rollout_correction``.

    Attributes:
        weights: (B, T) float32 IS weights, detached; 0 at padding, 1 (neutral) at invalid tokens; None
            when ``rollout_is`` is None. RS never changes them.
        response_mask: (B, T), same dtype as the input mask: the input mask with RS-rejected and invalid
            tokens set to 0. Use it for the advantage, the loss and the loss normaliser.
        stats: reducible statistics (on the input's device) behind the metrics.
    """

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    stats: CorrectionStats

    @property
    def metrics(self) -> dict[str, float]:
        """``rollout_corr/*`` metrics of this call alone, as Python floats (one device-to-host transfer)."""
        return self.stats.finalize()


# ---------------------------------------------------------------------- input handling
def _check_inputs(log_probs, rollout_log_probs, response_mask) -> None:
    if rollout_log_probs is None:
        raise ValueError(
            "rollout_log_probs (behaviour log-probs mu) are None but rollout correction is on: request the "
            "sampled tokens' log-probs from the rollout engine (vLLM: logprobs=0 with "
            "logprobs_mode='processed_logprobs'; transformers.generate: output_scores=True), or disable the "
            "correction."
        )
    if log_probs is None:
        raise ValueError("log_probs (pi_old in decoupled mode, pi_theta in bypass mode) are None.")
    if response_mask is None:
        raise ValueError("response_mask is None: pass the (B, T) 0/1 completion mask.")
    for name, t in (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs), ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(t.shape)}.")
    if not (log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            "Shapes differ: log_probs "
            f"{tuple(log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)}, response_mask "
            f"{tuple(response_mask.shape)}; all must be (B, T) over the same completion tokens (never padded or "
            "truncated silently)."
        )
    for name, t in (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (nats), got {t.dtype}.")
    if log_probs.device != rollout_log_probs.device or log_probs.device != response_mask.device:
        raise ValueError(
            f"Tensors are on different devices: log_probs {log_probs.device}, rollout_log_probs "
            f"{rollout_log_probs.device}, response_mask {response_mask.device}."
        )


# Speed and precision: every per-token quantity below is exactly 0 outside the valid tokens (x = clamp(l)
# is 0 there, so are k1, k2, k3 and the masked ratio R), so masked sums need no mask pass. Each (B, T)
# quantity is reduced to a (B,) row vector by a float32 row sum (cascade summation: ~1e-7 of the row's
# sum of |terms|, below the rounding of float32 log-probs); rows are combined in float64. Sums of squares
# go through a compensated per-row two-pass (``row_moments``) so that variances E[w^2] - E[w]^2 of weights near
# 1 stay exact, and k3 is expm1(x) - x (no cancellation). All row vectors go into a ``_RowTable`` whose
# reductions (sums, maxima, counts over valid rows) run as one matrix product and a few gathers, so the
# cost does not grow with the number of metrics. No (B, T) float64 tensor is formed for float32 inputs:
# a float64 copy costs more than the whole floor pass. Under torch.compile a few helpers switch to
# formulations that inductor fuses (``torch.compiler.is_compiling()`` branches; same results).
_BIG = 1e30  # float32 stand-in for +-inf in masked extrema (|x| <= 20, so x +- _BIG never rounds back to x)


def _mask_float(response_mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``response_mask > 0`` as float32 0/1 written into ``out`` (bool masks: read through uint8)."""
    if response_mask.dtype == torch.bool:
        return out.copy_(response_mask.view(torch.uint8))
    return torch.gt(response_mask, 0, out=out)


@dataclass
class _Prepared:
    """Cleaned per-token quantities shared by IS, RS and the metrics (all (B, T) unless noted).

    Masks are float32 0/1, never bool: on CPU every kernel that reads a bool tensor (where, masked_fill,
    bool & | ~, bool * float, bool.sum, any, bool -> float) is 5-30x slower than float32 arithmetic, and
    comparisons written into a float32 ``out=`` are ~8x faster than into bool. Work buffers are reused
    (``scratch``) so that a call touches few fresh pages.
    """

    response_mask: torch.Tensor  # the caller's mask (any dtype; > 0 means completion token)
    vf: torch.Tensor  # float32 1.0 at valid tokens (mask > 0 and finite log ratio), else 0.0
    x: torch.Tensor  # float32 clamp(l, -20, 20), 0 outside valid
    ratio: Optional[torch.Tensor]  # R = exp(x) at valid tokens, 0 elsewhere (None once consumed by the weights)
    n_row: torch.Tensor  # (B,) float32 valid tokens per row
    row_valid: torch.Tensor  # (B,) bool
    seq_l: torch.Tensor  # (B,) float64 sum of l over valid tokens (unclamped)
    n1: torch.Tensor  # (B,) float32 max(n_row, 1)
    n1_64: torch.Tensor  # (B,) float64 max(n_row, 1)
    n_row64: torch.Tensor  # (B,) float64 n_row
    exact_inputs: bool  # both log-prob inputs are float64 (l is formed in float64)
    n_masked: torch.Tensor  # (B,) float32 tokens with mask > 0 per row (valid + invalid)
    scratch: torch.Tensor  # (B, T) float32 work buffer (never returned)
    _has_x_range: bool = False
    _stat_rowsums: Optional[dict] = None
    _spare: Optional[torch.Tensor] = None

    def spare(self) -> torch.Tensor:
        """A second (B, T) float32 work buffer, allocated once; ``take_spare`` hands it over for good."""
        if self._spare is None:
            self._spare = torch.empty_like(self.x)
        return self._spare

    def take_spare(self) -> torch.Tensor:
        """The spare buffer (a fresh one once taken) to keep, e.g. as the returned mask; not used here again."""
        buf, self._spare = self.spare(), None
        return buf

    def row_moments(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Exact per-row sum and sum of squares of a zero-off-valid (B, T) float32 t.

        Returns ``(S, (M2, m))``: ``S`` (B,) float64 row sums, ``m = S / n`` (float64 row means) and ``M2``
        (B,) the float32 sum over valid tokens of ``(t - c)^2``, with c the float32 row mean, so that
        ``sum t^2 = M2 + n m^2`` to float64 rounding (``_RowTable.add_sq`` adds the two).

        Compensated two-pass: with ``c = fl(S32 / n)`` and ``d = t - c`` at valid tokens, ``S = n c + sum d``
        recovers the float32 row sum's rounding (sum d is a sum of small deviations), and ``sum d^2`` keeps
        the variance ``E[t^2] - E[t]^2`` exact when every t is ~1 +- 1e-4 (float32 squares of t would lose
        it; so would a float32 S, whose ~6e-8 relative error is larger than such a variance). The dropped
        term ``n (m - c)^2`` is ~1e-15 of ``n c^2``."""
        s32 = t.sum(-1)
        c = torch.div(s32, self.n1)
        compiling = torch.compiler.is_compiling()
        d = torch.addcmul(t, self.vf, c.unsqueeze(-1), value=-1.0, out=None if compiling else self.scratch)
        ds = d.sum(-1)
        m2 = (d * d).sum(-1) if compiling else d.square_().sum(-1)
        s64 = torch.addcmul(ds.double(), c.double(), self.n_row64)
        return s64, (m2, s64 / self.n1_64)

    def stat_rowsum(self, stat: str, t: torch.Tensor) -> torch.Tensor:
        """(B,) float64 row sums of the token statistic ``stat`` (``t``; ``k1x``: x), computed once."""
        if self._stat_rowsums is None:
            self._stat_rowsums = {}
        if stat not in self._stat_rowsums:
            self._stat_rowsums[stat] = _rowsum(t).double()  # float64: band edges compare in float64
        return self._stat_rowsums[stat]

    def valid_min_rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) min over valid tokens of a zero-off-valid float32 t (+_BIG on rows without one, never read)."""
        return torch.mul(self.vf, -_BIG, out=self.scratch).add_(_BIG).add_(t).amin(-1)


def _rowsum(t: torch.Tensor) -> torch.Tensor:
    """(B,) row sums of a (B, T) tensor in its own dtype.

    torch sums a row by cascade (pairwise-like) summation, so a float32 row sum is off by ~1e-7 of the sum of
    |terms| over the row (a 4096-token row of log ratios ~ +-0.03: ~1e-5 nats, less than the float32
    rounding of the log-probs themselves). Rows are then combined in float64 (``_RowTable``). A float64
    accumulation here would cost a (B, T) float64 copy (fresh pages: ~8x the floor at (256, 4096)).
    Sums whose variance is taken go through ``_Prepared.row_moments`` instead."""
    return t.sum(-1)


def _zero_invalid(t: torch.Tensor, vf: torch.Tensor, out: torch.Tensor, all_finite: bool = False) -> torch.Tensor:
    """t at valid tokens, 0 elsewhere (t may hold NaN/inf off-valid, unless ``all_finite``; vf is 0 there)."""
    if torch.compiler.is_compiling():  # inductor's CPU nan_to_num falls back to scalar code; where is vectorised
        return torch.where(vf > 0, t, 0.0)
    if all_finite:
        return torch.mul(t, vf, out=out)
    return torch.nan_to_num(t, 0.0, 0.0, 0.0, out=out).mul_(vf)


def _prepare(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, rows: "_RowTable") -> _Prepared:
    lp, rlp = log_probs.detach(), rollout_log_probs.detach()
    # Subtract in float64 when both inputs are float64; bf16/fp16 are upcast to float32 first.
    work = torch.float64 if lp.dtype == rlp.dtype == torch.float64 else torch.float32
    lp, rlp = lp.to(work), rlp.to(work)
    diff = lp - rlp  # fresh; becomes l (and x in place) for float32 work
    chk = torch.sub(diff, diff)  # 0 where diff is finite, NaN for NaN/+-inf in either input
    vf = _mask_float(response_mask, torch.empty(diff.shape, dtype=torch.float32, device=diff.device))
    n_masked = vf.sum(-1)
    rows.add("n_masked", n_masked, "sum_all")
    finite = torch.eq(chk, 0, out=chk)  # 1.0 where l (so both log-probs) is finite, padding included
    vf.mul_(finite)  # valid = mask > 0 and finite log ratio
    # On CPU a host-side check is free: when every entry is finite, zeroing needs no nan_to_num pass.
    all_finite = diff.device.type == "cpu" and not torch.compiler.is_compiling() and bool(finite.all())
    diff = _zero_invalid(diff, vf, out=diff, all_finite=all_finite)  # zero outside the valid tokens, finite everywhere
    seq_l = _rowsum(diff).double()
    n_row = vf.sum(-1)
    rows.set_rows(n_row)
    # training / rollout row sums over valid tokens, each summed directly so that an extreme value on one side
    # (a rollout engine's -1e8 for a filtered token) cannot swamp the other (chk is a work-dtype scratch buffer)
    rows.add("train_row_sum", _rowsum(_zero_invalid(lp, vf, out=chk, all_finite=all_finite)))
    rows.add("rollout_row_sum", _rowsum(_zero_invalid(rlp, vf, out=chk, all_finite=all_finite)))
    x = (diff if work == torch.float32 else diff.float()).clamp_(-SAFETY_BOUND, SAFETY_BOUND)
    scratch = chk if work == torch.float32 else torch.empty_like(x)
    ratio = torch.exp(x).mul_(vf)
    n1 = n_row.clamp(min=1)
    p = _Prepared(response_mask=response_mask, vf=vf, x=x, ratio=ratio, n_row=n_row, row_valid=n_row > 0,
                  seq_l=seq_l, n1=n1, n1_64=n1.double(), n_row64=rows.n, exact_inputs=work == torch.float64,
                  scratch=scratch, n_masked=n_masked)
    rows.add("n_tok", n_row, "sum", bucket=True)
    rows.add("n_seq", p.row_valid, "sum", bucket=True)
    return p


def _x_range(p: _Prepared, rows: "_RowTable") -> None:
    """Adds the max/min of x over valid tokens (``x_max``, ``x_min``) once (x -/+ _BIG off valid, no where).

    Runs before RS takes the spare buffer, which holds the shared penalty (0 at valid, -_BIG elsewhere)."""
    if not p._has_x_range:
        p._has_x_range = True
        if p.x.numel():
            pen = torch.sub(p.vf, 1.0, out=p.spare()).mul_(_BIG)
            rows.add("x", torch.add(p.x, pen, out=p.scratch).amax(-1), "max")
            rows.add("x", torch.sub(p.x, pen, out=p.scratch).amin(-1), "min")
        else:
            rows.add("x", p.seq_l, "max")
            rows.add("x", p.seq_l, "min")


class _RowTable:
    """Per-row (B,) values and the reductions each needs, evaluated together in a few batched ops.

    Reductions over valid rows (rows with at least one valid token): ``sum``, ``sq`` (sum of squares, stored
    as ``{name}2``), ``wsum``/``wsq`` (weighted by the row's valid-token count), ``max``/``min`` (stored as
    ``{name}_max``/``{name}_min``); ``sum_all`` sums over every row. ``gt``/``lt`` count valid rows whose
    value is above/below a threshold (a NaN value is never counted). ``bucket=True`` also sums the value
    over the valid rows of each response-length bucket (stored as ``{name}@{j}``).

    All sums come from one matrix product ``[V; V*V; hits; X_all] @ [valid, n, 1, buckets]`` (V: the
    values with invalid rows zeroed) followed by one gather; the bookkeeping (names, gather indices,
    thresholds) depends only on the sequence of ``add`` calls and is cached per sequence (``_PLANS``).
    """

    def __init__(self, bucket_edges: tuple[int, ...] = ()) -> None:
        self.values: list[torch.Tensor] = []
        self.index: dict[str, int] = {}
        self.signature: list[tuple] = []
        self.n: Optional[torch.Tensor] = None
        self.bucket_edges = bucket_edges

    def set_rows(self, n_row: torch.Tensor) -> None:
        self.n = n_row.double()

    def add(self, name: str, values: torch.Tensor, *kinds: str, gt: Optional[tuple[str, float]] = None, lt: Optional[tuple[str, float]] = None, bucket: bool = False, plus_wsq: Optional[int] = None) -> int:
        """Register a (B,) row vector; returns its index. ``plus_wsq``: index of a row vector m whose
        token-weighted sum of squares ``sum_i n_i m_i^2`` is added to this value's ``sum`` (and bucket sums)."""
        idx = len(self.values)
        self.values.append(values)  # converted to float64 once, in reduce()
        self.index.setdefault(name, idx)
        self.signature.append((name, kinds, gt, lt, bucket, plus_wsq))
        return idx

    def add_sq(self, name: str, sq: tuple[torch.Tensor, torch.Tensor], bucket: bool = False) -> None:
        """Register the row sums of squares returned by ``_Prepared.row_moments`` as the ``sum`` ``name``."""
        m2, mean = sq
        self.add(name, m2, "sum", bucket=bucket, plus_wsq=self.add(name + "_rowmean", mean))

    def col(self, name: str) -> torch.Tensor:
        """The named row vector as float64 (B,)."""
        return self.values[self.index[name]].double()

    def reduce(self, layout: tuple) -> CorrectionStats:
        dtypes = tuple(v.dtype for v in self.values)
        key = (tuple(self.signature), dtypes, self.bucket_edges)
        if torch.compiler.is_compiling():  # static at trace time; a cache lookup would only add guards
            plan = _ReducePlan(self.signature, dtypes, self.bucket_edges)
        else:
            plan = _PLANS.get(key)
            if plan is None:
                plan = _PLANS[key] = _ReducePlan(self.signature, dtypes, self.bucket_edges)
        return plan.run(self.values, self.n, layout)


class _ReducePlan:
    """Names and gather indices for ``_RowTable.reduce``, built once per sequence of ``add`` calls."""

    def __init__(self, signature: Sequence[tuple], dtypes: Sequence[torch.dtype], bucket_edges: tuple[int, ...]) -> None:
        K = len(signature)
        # Values are stacked per dtype (one same-dtype stack each, no per-value promotion) and the groups
        # concatenated: value i lands in row pos[i] of X.
        self.groups = [[i for i, d in enumerate(dtypes) if d == dt] for dt in dict.fromkeys(dtypes)]
        pos = {i: r for r, i in enumerate(i for g in self.groups for i in g)}
        nb = len(bucket_edges) + 1 if bucket_edges else 0
        self.bucket_edges = bucket_edges
        gts = [(cnt, i, thr, 1.0) for i, (_, _, gt, *_r) in enumerate(signature) if gt is not None for cnt, thr in (gt,)]
        lts = [(cnt, i, thr, -1.0) for i, (_, _, _, lt, *_r) in enumerate(signature) if lt is not None for cnt, thr in (lt,)]
        hits = gts + lts
        alls = [i for i, (_, kinds, *_rest) in enumerate(signature) if "sum_all" in kinds]
        self.hit_idx = [pos[i] for _, i, _, _ in hits]
        self.hit_thr = [thr * sign for _, _, thr, sign in hits]
        self.hit_sign = [sign for *_, sign in hits]
        self.all_idx = [pos[i] for i in alls]
        # rows of the product: V (K), V*V (K), hits (len(hits)), X[all] (len(alls)); columns: valid, n, one,
        # bucket indicators (nb), n * bucket indicators (nb)
        J = 3 + 2 * nb
        row_sq, row_hit, row_all = K, 2 * K, 2 * K + len(hits)
        flat = lambda r, c: r * J + c
        names, gather, extra_dst, extra_src = [], [], [], []
        order = {k: [] for k in ("sum", "sum_all", "sq", "wsum", "wsq")}
        for i, (name, kinds, _, _, _, plus) in enumerate(signature):
            for kind in kinds:
                if kind == "sum":
                    order[kind].append((name, flat(pos[i], 0)))
                    if plus is not None:
                        extra_dst.append(len(order["sum"]) - 1)  # sums come first, in this order
                        extra_src.append(flat(row_sq + pos[plus], 1))
                elif kind == "wsum":
                    order[kind].append((name, flat(pos[i], 1)))
                elif kind == "sq":
                    order[kind].append((name + "2", flat(row_sq + pos[i], 0)))
                elif kind == "wsq":
                    order[kind].append((name + "2", flat(row_sq + pos[i], 1)))
                elif kind == "sum_all":
                    order[kind].append((name, flat(row_all + alls.index(i), 2)))
        for kind in ("sum", "sum_all", "sq", "wsum", "wsq"):
            for name, g in order[kind]:
                names.append(name)
                gather.append(g)
        for i, (name, _, _, _, bucket, plus) in enumerate(signature):
            if bucket and nb:
                for j in range(nb):
                    if plus is not None:
                        extra_dst.append(len(names))
                        extra_src.append(flat(row_sq + pos[plus], 3 + nb + j))
                    names.append(f"{name}@{j}")
                    gather.append(flat(pos[i], 3 + j))
        for h, (cnt, _, _, _) in enumerate(hits):
            names.append(cnt)
            gather.append(flat(row_hit + h, 0))
        self.sum_names = tuple(names)
        self.gather, self.extra_dst, self.extra_src = gather, extra_dst, extra_src
        max_i = [i for i, (_, kinds, *_r) in enumerate(signature) if "max" in kinds]
        min_i = [i for i, (_, kinds, *_r) in enumerate(signature) if "min" in kinds]
        self.max_names = tuple(f"{signature[i][0]}_max" for i in max_i)
        self.min_names = tuple(f"{signature[i][0]}_min" for i in min_i)
        self.max_idx, self.min_idx = [pos[i] for i in max_i], [pos[i] for i in min_i]
        self._dev: dict = {}

    def _tensors(self, device: torch.device) -> tuple:
        t = self._dev.get(device)
        if t is None:
            f64 = dict(dtype=torch.float64, device=device)
            long = dict(dtype=torch.long, device=device)
            t = self._dev[device] = (
                torch.tensor(self.gather, **long), torch.tensor(self.hit_idx, **long),
                torch.tensor(self.hit_thr, **f64).unsqueeze(-1), torch.tensor(self.hit_sign, **f64).unsqueeze(-1),
                torch.tensor(self.all_idx, **long), torch.tensor(self.max_idx, **long), torch.tensor(self.min_idx, **long),
                torch.tensor(self.bucket_edges, **f64), torch.arange(len(self.bucket_edges) + 1, **long),
                torch.tensor(self.extra_dst, **long), torch.tensor(self.extra_src, **long),
            )
        return t

    def run(self, values: list[torch.Tensor], n: torch.Tensor, layout: tuple) -> CorrectionStats:
        gather, hit_idx, hit_thr, hit_sign, all_idx, max_idx, min_idx, edges, bucket_ids, extra_dst, extra_src = self._tensors(n.device)
        stacks = [torch.stack([values[i] for i in g]).double() for g in self.groups]
        X = stacks[0] if len(stacks) == 1 else torch.cat(stacks)  # (K, B) float64, rows in plan order
        B = X.shape[1]
        row_valid = n > 0
        V = torch.where(row_valid, X, 0.0)
        parts = [V, V * V]
        if len(hit_idx):
            parts.append(torch.gt(X.index_select(0, hit_idx) * hit_sign, hit_thr).double())
        if len(all_idx):
            parts.append(X.index_select(0, all_idx))
        cols = [row_valid.double(), n, torch.ones_like(n)]
        W = torch.stack(cols, -1)  # (B, 3)
        if self.bucket_edges:
            bucket = torch.bucketize(n, edges, right=True)
            in_bucket = (bucket.unsqueeze(-1) == bucket_ids).double() * W[:, :1]
            W = torch.cat([W, in_bucket, in_bucket * n.unsqueeze(-1)], -1)
        table = (torch.cat(parts) @ W).flatten()
        sums = table.index_select(0, gather)
        if len(extra_dst):
            sums.index_add_(0, extra_dst, table.index_select(0, extra_src))
        if B:
            maxs = torch.where(row_valid, X.index_select(0, max_idx), -math.inf).amax(-1)
            mins = torch.where(row_valid, X.index_select(0, min_idx), math.inf).amin(-1)
        else:
            maxs = torch.full((len(max_idx),), -math.inf, dtype=X.dtype, device=X.device)
            mins = torch.full((len(min_idx),), math.inf, dtype=X.dtype, device=X.device)
        return CorrectionStats(self.sum_names, sums, self.max_names, maxs, self.min_names, mins, layout)


_PLANS: dict = {}


# ---------------------------------------------------------------------- IS weights
def _token_weights(p: _Prepared, upper: float, lower: Optional[float]) -> torch.Tensor:
    """(B, T) token weights at valid tokens, 0 elsewhere (``p.ratio`` is 0 there and L, U > 0).

    TIS clamps ``p.ratio`` in place (one (B, T) buffer less); ``p.ratio`` is consumed (set to None)."""
    if lower is not None:  # IcePop: W = R inside [L, U], 0 outside
        w = torch.ge(p.ratio, lower, out=torch.empty_like(p.ratio))
        return w.mul_(torch.le(p.ratio, upper, out=p.scratch)).mul_(p.ratio)
    w = p.ratio.clamp_(max=upper)  # TIS
    p.ratio = None
    return w


def _importance_weights(p: _Prepared, config: RolloutCorrectionConfig, rows: _RowTable, all_reduce: Optional[AllReduce]) -> torch.Tensor:
    """(B, T) IS weights: 0 at padding, 1 at invalid tokens; adds the ``is_*`` statistics."""
    bounds = config.is_bounds
    upper, lower = bounds.upper, bounds.lower
    lower_m = lower if lower is not None else 1.0 / upper
    nd, n1 = rows.n, p.n1_64
    if config.rollout_is == "token":
        rows.add("is_high", _count_valid(p.ratio, ">", upper, p), "sum")  # ratio is 0 off valid
        rows.add("is_low", _count_valid(p.ratio, "<", lower_m, p), "sum")
        if not bounds.is_icepop:
            _x_range(p, rows)
        w = _token_weights(p, upper, lower)
        row_w, w_sq = p.row_moments(w)
        rows.add("is_w", row_w, "sum", bucket=True)  # per-row sums of W and W^2 (also for the length slices)
        rows.add_sq("is_w2", w_sq, bucket=True)
        if bounds.is_icepop:
            rows.add("is_w", w.amax(-1) if w.numel() else row_w, "max")  # W >= 0, 0 off-valid
            rows.add("is_w", p.valid_min_rows(w) if w.numel() else row_w, "min")
        row_mean_w = w_sq[1]
        row_mean_r = rows.col("r") / n1
        batch_total = (row_w.sum(), nd.sum())
    else:
        seq_ratio = torch.exp(p.seq_l.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B,) float64
        if bounds.is_icepop:
            seq_w = torch.where((seq_ratio >= lower) & (seq_ratio <= upper), seq_ratio, 0.0)
            rows.add("is_oob", (seq_ratio < lower) | (seq_ratio > upper), "wsum")
        else:
            seq_w = seq_ratio.clamp(max=upper)
        rows.add("is_w", nd * seq_w, "sum", bucket=True)  # per-row sums of W and W^2 (token-weighted)
        rows.add("is_w2", nd * seq_w * seq_w, "sum", bucket=True)
        rows.add("is_r", nd * seq_ratio, "sum")
        rows.add("is_r2", nd * seq_ratio * seq_ratio, "sum")
        rows.add("is_logw", p.seq_l, "max", "min", gt=("is_high", math.log(upper)), lt=("is_low", math.log(lower_m)))
        row_mean_w, row_mean_r = seq_w, seq_ratio
        valid_w = torch.where(p.row_valid, seq_w, 0.0)
        batch_total = (valid_w.sum(), p.row_valid.sum().double())
    rows.add("is_seq", row_mean_w, "sum", "sq", "max", "min")
    rows.add("is_seq_r", row_mean_r, gt=("is_seq_high", upper), lt=("is_seq_low", lower_m))

    if config.rollout_is_batch_normalize:
        total = torch.stack(batch_total)
        if all_reduce is not None:
            total = all_reduce(total)
        mean = total[0] / total[1].clamp(min=1)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        if config.rollout_is == "token":
            w = w.div_(factor.float())  # w is this function's own tensor
        else:
            seq_w = seq_w / factor
    if config.rollout_is == "sequence":
        w = torch.mul(p.vf, seq_w.float().unsqueeze(-1))
    # 0 at padding (w is 0 there); the neutral weight 1 at invalid tokens (mask 1, NaN/inf log-prob): + (mask - valid).
    if p.vf.device.type == "cpu" and not torch.compiler.is_compiling() and torch.equal(p.n_masked, p.n_row):
        return w  # no invalid token (a host-side check, free on CPU; skips three (B, T) passes)
    return w.add_(torch.sub(_mask_float(p.response_mask, p.scratch), p.vf, out=p.scratch))


def _count_valid(t: torch.Tensor, op: str, threshold: float, p: _Prepared) -> torch.Tensor:
    """(B,) number of valid tokens with ``t > threshold`` / ``t < threshold`` for a zero-off-valid ``t``:
    where the comparison holds at 0, the off-valid tokens (exactly T - n per row) are subtracted from the
    row count instead of masking the (B, T) comparison."""
    hit = (torch.gt if op == ">" else torch.lt)(t, threshold, out=p.scratch).sum(-1)
    if (0.0 > threshold) if op == ">" else (0.0 < threshold):
        return hit.sub_(t.shape[-1]).add_(p.n_row)
    return hit


def _compare_valid(t: torch.Tensor, op: str, threshold: float, p: _Prepared, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, T) float32 0/1: ``t > threshold`` or ``t < threshold`` at valid tokens, for a zero-off-valid ``t``
    (restricting to valid tokens is free when the comparison is False at 0). Written into ``out`` (default:
    the float32 scratch buffer)."""
    out = p.scratch if out is None else out
    if op == ">":
        hit = torch.gt(t, threshold, out=out)
        return hit.mul_(p.vf) if 0.0 > threshold else hit
    hit = torch.lt(t, threshold, out=out)
    return hit.mul_(p.vf) if 0.0 < threshold else hit


# ---------------------------------------------------------------------- RS masks
def _token_statistic(stat: str, p: _Prepared) -> torch.Tensor:
    """(B, T) k2 per token from x = clamp(l); 0 outside valid tokens (k1 = -x is never materialised; k3
    comes from ``_expm1_stats``)."""
    return torch.mul(p.x, p.x).mul_(0.5)


def _expm1_stats(p: _Prepared, keep_k3: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Row statistics of E = expm1(x) = R - 1 and of k3 = E - x (both 0 outside valid tokens).

    Returns ``(sum E, sum E^2, sum k3, k3)``: three (B,) float64 vectors and the (B, T) k3 tensor when
    ``keep_k3`` (token-level k3 options), else None. ``sum R = n + sum E`` and ``sum R^2 = n + 2 sum E + sum
    E^2`` then carry E's relative precision (~6e-8), so chi2 = E[R^2] - 1 stays exact when R ~ 1 +- 1e-5
    (float32 R itself is only known to ~6e-8 absolute, more than such a chi2).

    k3 = expm1(x) - x: the subtraction is exact for |x| < 1 (Sterbenz), so the relative error is that of
    expm1 alone, ~1.2e-7 / |x|, about what float32 log-probs of magnitude ~1 determine (an ulp of log pi ~
    -3 moves x by 2.4e-7, so k3 by 4.8e-7 / |x| relative). Float64 inputs get a float64 E and k3."""
    if torch.compiler.is_compiling():
        k3 = _k3_compiled(p.x)
        e = k3 + p.x
    elif p.exact_inputs:
        k3 = _k3_float64(p.x)
        e = k3 + p.x.double()
    else:
        e = torch.expm1(p.x, out=None if keep_k3 else p.scratch)
        e_row, e2_row = e.sum(-1), torch.mul(e, e, out=p.spare()).sum(-1)
        k3 = e.sub_(p.x)
        return e_row.double(), e2_row.double(), k3.sum(-1).double(), k3 if keep_k3 else None
    return e.sum(-1).double(), (e * e).sum(-1).double(), k3.sum(-1).double(), k3 if keep_k3 else None


def _k3_float64(x: torch.Tensor) -> torch.Tensor:
    """k3 in float64 for float64 inputs, whose log ratios are known far better than float32's expm1 (~6e-8
    relative) can render k3 ~ x^2 / 2 when |x| ~ 1e-6."""
    x64 = x.double()
    return torch.expm1(x64).sub_(x64)


def _k3_compiled(x: torch.Tensor) -> torch.Tensor:
    """k3 under torch.compile, where inductor's vectorised CPU code lowers expm1 to ``exp(x) - 1`` (which
    cancels for small x): the Taylor series sum_{n=2..8} x^n / n! for |x| <= 0.5 (truncation < 4e-8
    relative), ``exp(x) - 1 - x`` beyond (cancellation < 2e-6 relative). Fused, the extra flops are free."""
    small = x.abs() <= 0.5
    xs = torch.where(small, x, 0.0)
    poly = torch.full_like(xs, 1.0 / 40320.0)
    for n in (7, 6, 5, 4, 3, 2):
        poly = poly * xs + 1.0 / math.factorial(n)
    return torch.where(small, poly * xs * xs, torch.exp(x) - 1.0 - x)


def _rejection_keep(p: _Prepared, specs: Sequence[RSSpec], rows: _RowTable, token_stats: dict) -> torch.Tensor:
    """Returns the (B, T) float32 0/1 keep mask over valid tokens, combining every option (logical AND).

    k1 = -x is handled through x: ``k1 > hi <=> x < -hi``, ``clamp(k1, lo, hi) = -clamp(x, -hi, -lo)``."""
    keep: Optional[torch.Tensor] = None
    keep_row: Optional[torch.Tensor] = None
    n1 = p.n1
    if any(spec.stat == "k1" and spec.is_token_level for spec in specs):
        _x_range(p, rows)  # k1 = -x: token k1 extrema are those of x (before the spare becomes a mask)
    for spec in specs:
        pre = f"rollout_rs_{spec.option}_"
        lo, hi = spec.stat_bounds
        clamp_lo = lo if lo is not None else 0.0
        k1 = spec.stat == "k1"
        if spec.is_token_level:
            t = None if k1 else token_stats[spec.stat]
            rej = p.take_spare()  # rejected tokens (0/1); becomes the keep mask for the first option
            high = _compare_valid(p.x, "<", -hi, p, out=rej) if k1 else _compare_valid(t, ">", hi, p, out=rej)
            high_rows = high.sum(-1)
            rows.add(pre + "high", high_rows, "sum")
            if lo is not None:
                low = _compare_valid(p.x, ">", -lo, p) if k1 else _compare_valid(t, "<", lo, p)  # in scratch
                low_rows = low.sum(-1)
                rows.add(pre + "low", low_rows, "sum")
                rej.add_(low)  # high and low are disjoint
                high_rows = high_rows + low_rows
            rows.add(pre + "rejected_rows", high_rows, gt=(pre + "rejected_seqs", 0.0))
            if keep is None:
                keep = torch.sub(p.vf, rej, out=rej)
            else:
                keep.addcmul_(keep, rej, value=-1.0)  # keep * (1 - rej)
            if k1:
                row_sum = -p.stat_rowsum("k1x", p.x)
                clamped = torch.clamp(p.x, -hi, -clamp_lo, out=p.scratch)  # = -clamp(k1, lo, hi)
            else:
                row_sum = p.stat_rowsum(spec.stat, t)
                clamped = torch.clamp(t, clamp_lo, hi, out=p.scratch if t.dtype == torch.float32 else torch.empty_like(t))
            if not clamp_lo <= 0.0 <= hi:
                clamped.mul_(p.vf)
            csum, csum_sq = p.row_moments(clamped)
            rows.add(pre + "sum", row_sum, "sum")
            rows.add(pre + "csum", -csum if k1 else csum, "sum")
            rows.add_sq(pre + "csum2", csum_sq)
            if not k1:  # k2, k3 >= 0 and 0 outside valid tokens (k1 extrema: _x_range above)
                rows.add(pre[:-1], t.amax(-1) if t.numel() else row_sum, "max")  # -> {pre}max
                if not t.numel():
                    tmin = row_sum
                elif t.dtype == torch.float32:
                    tmin = p.valid_min_rows(t)
                else:
                    tmin = torch.where(p.vf > 0, t, math.inf).amin(-1)
                rows.add(pre[:-1], tmin, "min")
            row_values = row_sum / n1
        else:
            if spec.level == "seq_max":  # k2/k3 only, >= 0, so padding zeros never win over a valid token
                t = token_stats[spec.stat]
                row_values = t.amax(-1) if t.numel() else t.sum(-1)
            else:
                if k1:
                    row_sum = -p.stat_rowsum("k1x", p.x)
                elif spec.stat == "k3":
                    row_sum = p.stat_rowsum("k3", None)
                else:
                    row_sum = p.stat_rowsum(spec.stat, token_stats[spec.stat])
                row_values = row_sum if spec.level == "seq_sum" else row_sum / n1
            in_band = row_values <= hi
            if lo is not None:
                in_band = in_band & (row_values >= lo)
            bad = p.row_valid & ~in_band  # a NaN statistic is never in band: rejected
            keep_row = ~bad if keep_row is None else keep_row & ~bad
            rows.add(pre + "sum", row_values, "wsum")
            clamped = row_values.clamp(clamp_lo, hi)
            rows.add(pre + "csum", clamped, "wsum", "wsq")  # -> {pre}csum, {pre}csum2
            rows.add(pre + "rejected", bad, "wsum")
            rows.add(pre + "rejected_seqs", bad, "sum")
        rows.add(pre + "seq", row_values, "sum", "sq", "max", "min", gt=(pre + "seq_high", hi), lt=((pre + "seq_low", lo) if lo is not None else None))
    if keep is None:
        keep = p.vf.clone() if keep_row is not None else p.vf
    if keep_row is not None:
        keep.mul_(keep_row.to(keep.dtype).unsqueeze(-1))
    kept_rows = keep.sum(-1)
    rows.add("rs_kept", kept_rows, "sum", bucket=True)
    rows.add("rs_kept_minus_n", kept_rows - p.n_row, lt=("rs_rejected_seqs", 0.0))
    return keep


# ---------------------------------------------------------------------- entry point
def compute_rollout_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    all_reduce: Optional[AllReduce] = None,
    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> RolloutCorrectionOutput:
    """IS weights, RS mask and reducible ``rollout_corr/*`` statistics for one batch.

    Args:
        log_probs: (B, T) log-probs of the sampled tokens under the training policy, in nats: pi_old
            (``old_log_probs``) in decoupled mode, pi_theta (``log_probs``, detached here) in bypass mode.
            bf16/fp16 are upcast to float32.
        rollout_log_probs: (B, T) behaviour log-probs mu from the rollout engine, in nats.
        response_mask: (B, T) completion mask (bool, int or float). It is boolean: entries > 0 are
            completion tokens, 0, negative and NaN entries are not; values are never used as weights.
        config: a validated ``RolloutCorrectionConfig``.
        all_reduce: optional callable summing a small 1-D tensor across ranks, used only for batch
            normalisation so that it divides by the global-batch mean. None: this batch is the global batch.
        length_buckets: increasing response-length edges (valid tokens per row) for the length slices
            ``rollout_corr/len_{lo}_{hi}/*`` (kl, k3_kl, rs_masked_fraction, is_eff_sample_size, num_seqs);
            ``()`` turns them off. Rows with ``lo <= length < hi`` fall in a slice; the last one is open.

    Returns:
        ``RolloutCorrectionOutput`` with ``weights`` ((B, T) float32 or None), ``response_mask`` (RS and
        invalid tokens removed) and ``stats`` (``.metrics`` finalises them).

    Raises:
        ValueError: ``rollout_log_probs`` is None (names the fix), shapes differ, tensors are not 2-D or on
            different devices.
        TypeError: non-tensor or non-float log-probs.

    Tokens whose log-probs are NaN or +-inf where the mask is 1 are *invalid*: they are removed from the
    mask, get weight 1, take no part in sequence sums, means or metrics, and are counted in
    ``rollout_corr/invalid_token_fraction``. NaN/inf at padding is ignored.
    """
    _check_inputs(log_probs, rollout_log_probs, response_mask)
    edges = tuple(int(e) for e in length_buckets)
    if any(b <= a for a, b in zip(edges, edges[1:])) or any(e <= 0 for e in edges):
        raise ValueError(f"length_buckets must be increasing positive token counts, got {tuple(length_buckets)}.")
    rows = _RowTable(edges)
    p = _prepare(log_probs, rollout_log_probs, response_mask, rows)
    # k2/k3 (B, T) tensors only where an option tests tokens, takes a row max or needs k2 sums; E = R - 1 and
    # k3 row sums (always needed by the off-policy metrics) go through the scratch buffer.
    needed = {sp.stat for sp in config.rs_specs if sp.stat != "k1" and (sp.is_token_level or sp.level == "seq_max" or sp.stat == "k2")}
    e_row, e2_row, k3_row, k3_tok = _expm1_stats(p, keep_k3="k3" in needed)
    n64 = p.n_row64
    rows.add("r", n64 + e_row, "sum")  # sum of R over valid tokens
    rows.add("r2", n64 + 2.0 * e_row + e2_row, "sum")  # sum of R^2
    token_stats = {stat: (k3_tok if stat == "k3" else _token_statistic(stat, p)) for stat in needed}
    p._stat_rowsums = {"k3": k3_row}
    weights = _importance_weights(p, config, rows, all_reduce) if config.is_enabled else None
    keep = _rejection_keep(p, config.rs_specs, rows, token_stats) if config.rs_enabled else p.vf
    _offpolicy_stats(p, rows)
    layout = _layout(config) + ((("buckets", edges),) if edges else ())
    return RolloutCorrectionOutput(weights=weights, response_mask=keep.to(response_mask.dtype), stats=rows.reduce(layout))


def _offpolicy_stats(p: _Prepared, rows: _RowTable) -> None:
    rows.add("l", p.seq_l, "sum", bucket=True)
    rows.add("k3", p.stat_rowsum("k3", None), "sum", bucket=True)  # k3 is 0 outside valid tokens
    n1 = p.n1_64
    mean_roll = rows.col("rollout_row_sum") / n1  # mean log mu per row
    mean_train = rows.col("train_row_sum") / n1  # mean log pi_train per row
    d = -p.seq_l / n1  # mean(log mu - log pi_train) per row
    rows.add("train_log_ppl", -mean_train, "sum")
    rows.add("train_ppl", torch.exp((-mean_train).clamp(max=700.0)), "sum")
    rows.add("roll_log_ppl", -mean_roll, "sum")
    rows.add("roll_ppl", torch.exp((-mean_roll).clamp(max=700.0)), "sum")
    rows.add("d", d, "sum", "max", "min")
    rows.add("abs_d", d.abs(), "sum")
    rows.add("exp_d", torch.exp(d.clamp(max=700.0)), "sum")
    rows.add("seq_r2", torch.exp(2.0 * p.seq_l.clamp(-SAFETY_BOUND, SAFETY_BOUND)), "sum")


def _layout(config: RolloutCorrectionConfig) -> tuple:
    items = []
    if config.is_enabled:
        b = config.is_bounds
        lower_m = b.lower if b.lower is not None else 1.0 / b.upper
        items.append(("is", (config.rollout_is, b.upper, lower_m, b.is_icepop, config.rollout_is_batch_normalize)))
    if config.rs_enabled:
        items.append(("rs", tuple((sp.option, sp.stat, sp.is_token_level, *sp.stat_bounds) for sp in config.rs_specs)))
    return tuple(items)


def rollout_log_probs_to_tensor(
    per_row: Sequence[Optional[Sequence[Optional[float]]]], completion_mask: torch.Tensor
) -> torch.Tensor:
    """Lay per-row behaviour log-probs from a rollout engine out as a (B, T) tensor aligned with the mask.

    Args:
        per_row: B sequences of per-token log-probs (nats), one per sampled completion token, in order.
            A ``None`` entry (engine returned no log-prob for that token) becomes NaN, i.e. an invalid
            token (see ``compute_rollout_correction``).
        completion_mask: (B, T) 0/1; row i must be ``len(per_row[i])`` ones followed by zeros
            (right padding, as TRL lays out completions).

    Returns:
        (B, T) float32 on the mask's device; NaN where the engine gave None, 0 at padding.

    Raises:
        ValueError: if B differs, a row is None, a row's length differs from its completion length, or a
            mask row is not right-padded (the message names the row; nothing is padded or truncated silently).
    """
    if len(per_row) != completion_mask.shape[0]:
        check_aligned([0] * completion_mask.shape[0], per_row)  # raises: the row counts differ
    ones = completion_mask != 0
    lengths = ones.sum(-1)
    prefix = torch.arange(ones.shape[1], device=ones.device).unsqueeze(0) < lengths.unsqueeze(-1)
    bad_rows = (ones != prefix).any(-1).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(
            f"Row {bad_rows[0]}: the completion mask is not a run of ones followed by padding; behaviour log-probs "
            "can only be laid out for right-padded completions (nothing is shifted silently)."
        )
    lengths = lengths.tolist()
    check_aligned(lengths, per_row)
    out = torch.zeros(completion_mask.shape, dtype=torch.float32)
    for i, (row, n) in enumerate(zip(per_row, lengths)):
        if n:
            out[i, :n] = torch.tensor([float("nan") if v is None else float(v) for v in row], dtype=torch.float32)
    return out.to(completion_mask.device)


@dataclass
class RatioDecomposition:
    """Per-token log ratios between the three policies (all (B, T) float32, nats, 0 outside valid tokens).

    ``engine = log pi_old - log mu``, ``update = log pi_theta - log pi_old``, ``direct = log pi_theta - log mu``;
    ``direct == engine + update`` exactly where valid (computed that way). ``valid`` is the (B, T) bool mask
    of tokens where all three log-probs are finite and the mask is 1.
    """

    engine: torch.Tensor
    update: torch.Tensor
    direct: torch.Tensor
    valid: torch.Tensor


def ratio_decomposition(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> RatioDecomposition:
    """Split the direct ratio pi_theta / mu into the engine ratio pi_old / mu and the update ratio pi_theta / pi_old.

    Args:
        log_probs, old_log_probs, rollout_log_probs: (B, T) pi_theta, pi_old, mu in nats (any float dtype).
        response_mask: (B, T) 0/1.

    Returns:
        RatioDecomposition (log ratios; exponentiate for ratios).

    Raises:
        ValueError: if the shapes differ.
    """
    if not (log_probs.shape == old_log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"Shapes differ: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, response_mask {tuple(response_mask.shape)}."
        )
    lp, old, mu = (t.detach().float() for t in (log_probs, old_log_probs, rollout_log_probs))
    valid = (response_mask != 0) & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(mu)
    engine = torch.where(valid, old - mu, 0.0)
    update = torch.where(valid, lp - old, 0.0)
    return RatioDecomposition(engine=engine, update=update, direct=engine + update, valid=valid)


_COMPILED: dict = {}


def compiled_rollout_correction(
    config: RolloutCorrectionConfig, *, length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, **compile_kwargs
) -> Callable[..., RolloutCorrectionOutput]:
    """``compute_rollout_correction`` for one config, compiled with ``torch.compile`` (inductor).

    The eager function makes ~40 passes over the (B, T) inputs plus ~150 small row-level operations;
    inductor fuses them into a handful of loops (same results to float rounding; about 2x faster than eager
    on CPU, see ``benchmarks/RESULTS.md``). The first call compiles (10-30 s on CPU); shapes are dynamic, so
    new (B, T) do not recompile. Compiled functions are cached per (config, length_buckets, compile options).

    Args:
        config: a validated ``RolloutCorrectionConfig``.
        length_buckets: as ``compute_rollout_correction``.
        **compile_kwargs: passed to ``torch.compile`` (default ``dynamic=True``).

    Returns:
        ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None) -> RolloutCorrectionOutput``.
    """
    compile_kwargs.setdefault("dynamic", True)
    key = (repr(config.to_dict()), tuple(length_buckets), repr(sorted(compile_kwargs.items())))
    if key not in _COMPILED:
        buckets = tuple(length_buckets)

        def run(log_probs, rollout_log_probs, response_mask, all_reduce=None):
            return compute_rollout_correction(
                log_probs, rollout_log_probs, response_mask, config, all_reduce=all_reduce, length_buckets=buckets
            )

        _COMPILED[key] = torch.compile(run, **compile_kwargs)
    return _COMPILED[key]


def make_correction_fn(
    config: RolloutCorrectionConfig, *, compile: bool = False, length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS
) -> Callable[..., RolloutCorrectionOutput]:
    """The correction for one config as ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None)``.

    Args:
        config: a validated ``RolloutCorrectionConfig``.
        compile: run it through ``torch.compile`` (``compiled_rollout_correction``: same values, faster on large
            batches; the first call compiles).
        length_buckets: as ``compute_rollout_correction``.

    Returns:
        A callable returning ``RolloutCorrectionOutput``; the one signature the trainer and the losses use.
    """
    if compile:
        return compiled_rollout_correction(config, length_buckets=length_buckets)
    buckets = tuple(length_buckets)

    def correction_fn(log_probs, rollout_log_probs, response_mask, all_reduce=None):
        return compute_rollout_correction(
            log_probs, rollout_log_probs, response_mask, config, all_reduce=all_reduce, length_buckets=buckets
        )

    return correction_fn
