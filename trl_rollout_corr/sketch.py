"""Quantiles of per-token values in memory that does not grow with the token count: exact while a window is small,
a mergeable log-bucket sketch above.

The ``rollout_corr/{engine,update,lag,direct}_ratio_p01/p50/p99`` and ``support_size_p50/p99`` metrics are
quantiles over every trained token of a log window on every rank. Keeping and gathering every token (the exact
path) costs 8 bytes a token on every rank and a sort of all of them: 1 GB per rank at 64 ranks x 2M tokens. A
``ValueSketch`` instead keeps

* the values themselves while the window holds at most ``exact_max`` (``EXACT_MAX`` = 65,536) of them, over all
  ranks: the metrics are then the exact order statistics, bit-identical to a sort of every value;
* above that, a histogram over a fixed ``BucketLayout`` (int64 counts, summed across ranks with one all-reduce), the
  exact minimum and maximum (one MAX all-reduce) and the exact count and sum (the mean stays exact).

A quantile of the histogram is read like the exact one: ``q (n - 1)`` is a position between two order statistics
``k`` and ``k + 1`` and the result interpolates linearly between them (as ``torch.quantile``); each order statistic
is the representative of the bucket that holds it (``searchsorted`` on the cumulative counts), clamped to the exact
[min, max], and the first / last order statistic is the exact min / max. The layouts are DDSketch's log buckets
(Masson, Rim and Lee, "DDSketch: a fast and fully-mergeable quantile sketch with relative-error guarantees",
VLDB 2019): a bucket ``[a, a gamma)`` with ``gamma = (1 + alpha) / (1 - alpha)`` is represented by
``2 a b / (a + b)``, within a relative ``alpha`` of every value in it. Error bounds
(``docs/how-to/read-the-metrics.md``):

* ratios (``ratio_layout``, over the log ratio l clamped at +-``SAFETY_BOUND``): each order statistic of l is within
  ``max(RATIO_ALPHA |l|, RATIO_FLOOR)`` nats (``RATIO_ALPHA`` = 1e-3, ``RATIO_FLOOR`` = 1e-9: |l| below it is
  bucketed as 0), so a ratio quantile is within a relative ``exp(RATIO_ALPHA |l| + RATIO_FLOOR) - 1`` of the
  exact one (|l| the larger of the two order statistics': 1e-4 at a ratio of 1.105 or 0.905, 0.1 % at e^+-1, 2 % at
  the clamp e^+-20);
* sizes (``size_layout``, integers >= 0): exact for sizes <= ``SIZE_EXACT`` (4,096: one bucket per integer), within
  a relative ``SIZE_ALPHA`` (1e-3) above.

``bounds`` returns, per quantile, the interval the exact value is guaranteed to lie in (from the bucket edges, not
from the bound above): ``analyze`` checks logs against it.

Memory: a ratio sketch is 23,721 buckets (190 KB of int64 counts), a size sketch 8,256 (66 KB), plus up to
``EXACT_MAX`` float64 values (512 KB) while the window is small; whatever the tokens or the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch

from .correction import SAFETY_BOUND

EXACT_MAX = 65_536  # values over all ranks up to which a window's quantiles are exact (kept and all-reduced)
RATIO_ALPHA = 1e-3  # relative accuracy of a log ratio's bucket representative
RATIO_FLOOR = 1e-9  # nats: |l| below it is bucketed as 0
SIZE_EXACT = 4096  # sizes up to it have a bucket each (exact)
SIZE_ALPHA = 1e-3  # relative accuracy of a size above SIZE_EXACT
SIZE_BOUND = float(2 ** 24)  # the last size bucket is open above this (its values are clamped to the exact max)
# Quantiles logged for the ratio decomposition (rollout_corr/{engine,update,direct}_ratio_p01/p50/p99).
RATIO_QUANTILES = (("p01", 0.01), ("p50", 0.5), ("p99", 0.99))


# ---------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True, eq=False)
class BucketLayout:
    """A fixed partition of the real line into K buckets, and how each is represented.

    Attributes:
        name: ``"ratio"`` or ``"size"``.
        edges: (K - 1,) float64 ascending: bucket j holds ``edges[j-1] <= v < edges[j]`` (bucket 0 everything below
            ``edges[0]``, bucket K - 1 everything from ``edges[-1]``).
        lower, upper: (K,) float64: the interval bucket j's values lie in (+-inf for the open end buckets).
        representative: (K,) float64: the value an order statistic in bucket j is read as.
        clamp: values are clamped to [-clamp, clamp] first (the ratios' ``SAFETY_BOUND``), or None.
        exp: quantiles interpolate between ``exp`` of the order statistics (ratios from log ratios), not the values.
    """

    name: str
    edges: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    representative: torch.Tensor
    clamp: Optional[float]
    exp: bool

    @property
    def size(self) -> int:
        """K, the number of buckets."""
        return self.representative.numel()

    def prepare(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) float64 values as the sketch holds them (flattened, clamped)."""
        v = values.detach().reshape(-1).double()
        return v if self.clamp is None else v.clamp(-self.clamp, self.clamp)

    def counts(self, values: torch.Tensor) -> torch.Tensor:
        """(K,) int64 number of ``values`` (prepared, (N,)) in each bucket, on their device."""
        index = torch.bucketize(values, self.edges.to(values.device), right=True)
        counts = torch.zeros(self.size, dtype=torch.int64, device=values.device)
        return counts.index_add_(0, index, torch.ones_like(index))  # no host sync (bincount syncs on CUDA)


def _log_buckets(start: float, alpha: float, bound: float) -> torch.Tensor:
    """(M + 1,) float64 edges ``start gamma^i``, i = 0..M, the first M with ``start gamma^M >= bound``."""
    log_gamma = math.log((1 + alpha) / (1 - alpha))
    m = math.ceil(math.log(bound / start) / log_gamma)
    return start * torch.exp(torch.arange(m + 1, dtype=torch.float64) * log_gamma)


def _harmonic(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """2 a b / (a + b): within a relative (gamma - 1) / (gamma + 1) = alpha of [a, b], b = a gamma."""
    return 2 * a * b / (a + b)


@lru_cache(maxsize=None)
def ratio_layout(alpha: float = RATIO_ALPHA, floor: float = RATIO_FLOOR, bound: float = SAFETY_BOUND) -> BucketLayout:
    """Buckets over the log ratio l (nats): ``(-floor, floor)`` as 0, log buckets of relative width ``alpha`` in |l|
    from ``floor`` to ``bound`` on both sides (2K + 1 buckets, K = ceil(ln(bound / floor) / ln gamma): 23,721 at the
    defaults). Values are clamped at +-``bound`` (as the exact ratios: ``exp(clamp(l, -20, 20))``)."""
    m = _log_buckets(floor, alpha, bound)  # m_0 = floor .. m_K >= bound
    k = m.numel() - 1
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat([-m[:k].flip(0), m[:k]])
    neg_rep = -_harmonic(m[:k], m[1:]).flip(0)  # buckets 0..K-1: [-m_{K-j}, -m_{K-1-j})
    pos_rep = _harmonic(m[:k], m[1:])  # buckets K+1..2K: [m_i, m_{i+1})
    representative = torch.cat([neg_rep, torch.zeros(1, dtype=torch.float64), pos_rep])
    lower = torch.cat([-inf, edges])
    upper = torch.cat([edges, inf])
    return BucketLayout("ratio", edges, lower, upper, representative, clamp=bound, exp=True)


@lru_cache(maxsize=None)
def size_layout(exact: int = SIZE_EXACT, alpha: float = SIZE_ALPHA, bound: float = SIZE_BOUND) -> BucketLayout:
    """Buckets over non-negative integers (kept-set sizes): one per integer 0..``exact`` (exact), then log buckets
    of relative width ``alpha`` from ``exact + 0.5`` up to ``bound`` (the last one open). 8,256 at the defaults."""
    logs = _log_buckets(exact + 0.5, alpha, bound)
    edges = torch.cat([torch.arange(exact + 1, dtype=torch.float64) + 0.5, logs[1:-1]])
    ints = torch.arange(exact + 1, dtype=torch.float64)
    representative = torch.cat([ints, _harmonic(logs[:-1], logs[1:])])
    inf = torch.tensor([math.inf], dtype=torch.float64)
    lower = torch.cat([-inf, ints[1:], logs[:-1]])
    upper = torch.cat([ints, logs[1:-1], inf])
    return BucketLayout("size", edges, lower, upper, representative, clamp=None, exp=False)


# ---------------------------------------------------------------------------------------------- the sketch
class ValueSketch:
    """The values of a window (one rank's, or all ranks' after ``reduce_sketches``): exact while at most
    ``exact_max``, else bucket counts, exact min / max / count / sum; mergeable across micro-batches and ranks.

    Args:
        layout: the ``BucketLayout`` (``ratio_layout()`` for log ratios, ``size_layout()`` for sizes).
        exact_max: the count above which the values are dropped for the counts (None: the module's ``EXACT_MAX``
            when the sketch is made; 0: always counts).

    Attributes:
        n: number of values added. values: the prepared values (list of (N_i,) float64) while ``n <= exact_max``,
            else None. counts: (K,) int64 once the values are dropped. low, high: exact min / max (0-d float64,
            clamped values); total: sum of the values (``exp`` of them for a ratio layout), 0-d float64; all three
            set with ``counts``.
    """

    def __init__(self, layout: BucketLayout, exact_max: Optional[int] = None) -> None:
        exact_max = EXACT_MAX if exact_max is None else exact_max
        if exact_max < 0:
            raise ValueError(f"exact_max must be >= 0 (0: always the sketch), got {exact_max}.")
        self.layout, self.exact_max = layout, int(exact_max)
        self.n = 0
        self.values: Optional[list[torch.Tensor]] = []
        self.counts: Optional[torch.Tensor] = None
        self.low = self.high = self.total = None
        self.device: Optional[torch.device] = None

    @property
    def exact(self) -> bool:
        """Whether the values themselves are kept (``n <= exact_max``)."""
        return self.values is not None

    def add(self, values: torch.Tensor) -> "ValueSketch":
        """Add ``values`` (any shape, any float dtype; pass only valid tokens). A ratio layout clamps +-inf to its
        bound (``prepare``); a value still non-finite after that (NaN; +-inf in a size layout) has no place in a
        quantile and is refused, never dropped or counted silently. No host sync (``torch._assert_async``).
        Returns self.

        Raises:
            RuntimeError: a non-finite value (on CPU at once; on an accelerator as a device-side assertion).
        """
        v = self.layout.prepare(values)
        torch._assert_async(torch.isfinite(v).all(), f"ValueSketch.add: a non-finite value (NaN, or inf in a "
                            f"{self.layout.name} layout) cannot be sketched; pass only the valid tokens' finite "
                            "values (mask NaN out first)")
        self.device = self.device or v.device
        self.n += v.numel()
        if self.values is not None:
            self.values.append(v)
            if self.n > self.exact_max:
                self._to_counts()
        else:
            self._count(v)
        return self

    def _to_counts(self) -> None:
        values, self.values = self.values, None
        self._count(torch.cat(values) if values else torch.zeros(0, dtype=torch.float64, device=self.device))

    def _count(self, v: torch.Tensor) -> None:
        dev = self.device
        counts = self.layout.counts(v.to(dev))
        total = (v.exp() if self.layout.exp else v).sum()
        low = v.min() if v.numel() else torch.tensor(math.inf, dtype=torch.float64, device=dev)
        high = v.max() if v.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=dev)
        if self.counts is None:
            self.counts, self.total, self.low, self.high = counts, total, low, high
        else:
            self.counts = self.counts + counts
            self.total = self.total + total
            self.low, self.high = torch.minimum(self.low, low), torch.maximum(self.high, high)

    def merge(self, other: "ValueSketch") -> "ValueSketch":
        """A new sketch of both windows' values (``self`` first); the inputs are unchanged.

        Raises:
            ValueError: sketches of different layouts or ``exact_max``.
        """
        if other.layout is not self.layout or other.exact_max != self.exact_max:
            raise ValueError(f"cannot merge a {other.layout.name} sketch (exact_max {other.exact_max}) into a "
                             f"{self.layout.name} sketch (exact_max {self.exact_max}).")
        out = ValueSketch(self.layout, self.exact_max)
        out.device = self.device or other.device
        for part in (self, other):
            if part.values is not None:
                for v in part.values:
                    out.add(v)
            else:
                if out.values is not None:
                    out._to_counts()
                out.n += part.n
                out._absorb(part.counts, part.total, part.low, part.high)
        return out

    def _absorb(self, counts, total, low, high) -> None:
        dev = self.device
        counts, total, low, high = (t.to(dev) for t in (counts, total, low, high))
        if self.counts is None:
            self.counts, self.total, self.low, self.high = counts, total, low, high
        else:
            self.counts, self.total = self.counts + counts, self.total + total
            self.low, self.high = torch.minimum(self.low, low), torch.maximum(self.high, high)

    # ------------------------------------------------------------------------------------------ read-out
    def exact_values(self) -> Optional[torch.Tensor]:
        """(n,) the values (clamped), or None once they are counted."""
        if self.values is None:
            return None
        return torch.cat(self.values) if self.values else torch.zeros(0, dtype=torch.float64, device=self.device)

    def quantiles(self, qs: Sequence[float]) -> list[tuple[float, float, float]]:
        """(estimate, lower, upper) per quantile q in [0, 1] of the (``exp`` of the, ratio layout) values, linear
        interpolation between order statistics as ``torch.quantile``; the exact value lies in [lower, upper].

        Exact values: estimate = lower = upper (the exact quantile). Counts: see the module docstring.

        Raises:
            ValueError: an empty sketch (a quantile of no value is not logged: check ``n`` first).
        """
        if self.n == 0:
            raise ValueError("no value in the sketch: a quantile of no value is undefined (not logged).")
        n = self.n
        exact = self.exact_values()
        if exact is not None:
            v = exact.sort().values
            t = v.exp() if self.layout.exp else v
            out = []
            for q in qs:
                pos = q * (n - 1)
                lo = int(math.floor(pos))
                hi = min(lo + 1, n - 1)
                value = float(t[lo] + (pos - lo) * (t[hi] - t[lo]))
                out.append((value, value, value))
            return out
        L = self.layout
        cum = self.counts.cpu().cumsum(0)
        low, high = float(self.low), float(self.high)
        rep, lower, upper = L.representative, L.lower, L.upper

        def order_statistic(k: int) -> tuple[float, float, float]:
            if k == 0:
                return low, low, low
            if k == n - 1:
                return high, high, high
            b = int(torch.searchsorted(cum, torch.tensor([k]), right=True)[0])
            clamp = lambda x: min(max(float(x), low), high)  # noqa: E731
            return clamp(rep[b]), clamp(lower[b]), clamp(upper[b])

        f = math.exp if L.exp else float
        out = []
        for q in qs:
            pos = q * (n - 1)
            lo = int(math.floor(pos))
            hi = min(lo + 1, n - 1)
            w = pos - lo
            a, b = order_statistic(lo), order_statistic(hi)
            out.append(tuple(f(x) + w * (f(y) - f(x)) for x, y in zip(a, b)))
        return out


def exact_ratio_quantiles(log_ratios: torch.Tensor) -> dict[str, float]:
    """Mean, p01, p50, p99 and max of the ratios ``exp(clamp(l, -SAFETY_BOUND, SAFETY_BOUND))``.

    Exact order statistics (not a mean of per-rank or per-batch quantiles): the values are sorted once and the
    quantiles interpolate linearly between order statistics, as ``torch.quantile``. Memory and time grow with N:
    ``ratio_metrics`` uses it only while a window holds at most ``EXACT_MAX`` values.

    Args:
        log_ratios: (N,) log ratios in nats (any float dtype; float64 as the accumulator keeps them).

    Returns:
        ``{"mean", "p01", "p50", "p99", "max"}`` ratio values (unitless), one host transfer; ``{}`` when ``N == 0``
        (a statistic over no token is not logged, never 0: ``docs/how-to/read-the-metrics.md``, "Steps with no rows").
    """
    if log_ratios.numel() == 0:
        return {}
    ratio = torch.exp(log_ratios.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sort().values
    n = ratio.numel()
    out = {"mean": ratio.mean()}
    for key, q in RATIO_QUANTILES:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out[key] = ratio[lo] + (pos - lo) * (ratio[hi] - ratio[lo])
    out["max"] = ratio[-1]
    host = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out.values()]).cpu().tolist()
    return dict(zip(out.keys(), host))


def ratio_metrics(sketch: ValueSketch) -> dict[str, float]:
    """``{"mean", "p01", "p50", "p99", "max"}`` of the ratios of a (reduced) log-ratio sketch; ``{}`` over no value.

    Exact values: ``exact_ratio_quantiles`` (bit-identical to the exact path). Counts: mean = total / n and max
    exact, the quantiles within the bound of the module docstring."""
    exact = sketch.exact_values()
    if exact is not None:
        return exact_ratio_quantiles(exact)
    if sketch.n == 0:
        return {}
    qs = sketch.quantiles([q for _, q in RATIO_QUANTILES])
    out = {"mean": float(sketch.total) / sketch.n}
    out.update({key: est for (key, _), (est, _, _) in zip(RATIO_QUANTILES, qs)})
    out["max"] = math.exp(float(sketch.high))
    return out


def ratio_bounds(sketch: ValueSketch) -> dict[str, tuple[float, float]]:
    """``{"p01", "p50", "p99"} -> (lower, upper)``: where the exact quantiles lie, for a sketch that counts (``{}``
    for exact values or no value: the logged values are then the exact ones)."""
    if sketch.exact or sketch.n == 0:
        return {}
    qs = sketch.quantiles([q for _, q in RATIO_QUANTILES])
    return {key: (lo, hi) for (key, _), (_, lo, hi) in zip(RATIO_QUANTILES, qs)}


# ---------------------------------------------------------------------------------------------- across ranks
def reduce_sketches(sketches: Sequence[ValueSketch], reducers) -> list[ValueSketch]:
    """The sketches of all ranks (one per input, in order), equal on every rank.

    Every rank must pass sketches of the same layouts in the same order (it runs collectives). Collectives: one
    all-gather of the (S,) local counts; one float64 sum of [the values of the windows with at most ``exact_max``
    values over all ranks, each rank's placed at its rank's offset; the counts and totals of the others]; one max of
    [max, -min] of the others (only when there are others). Memory: at most ``exact_max`` values per small window plus
    K buckets per large one, whatever the world size.

    Args:
        sketches: this rank's sketches. reducers: ``accumulator.Reducers`` (``world_size``, ``rank``, ``sum``,
            ``max``, ``gather``).
    """
    world = reducers.world_size
    if world <= 1 or not sketches:
        return list(sketches)
    device = next((s.device for s in sketches if s.device is not None), torch.device("cpu"))
    local = torch.tensor([s.n for s in sketches], dtype=torch.int64, device=device)
    per_rank = reducers.gather(local).view(world, len(sketches)).cpu()
    totals = per_rank.sum(0).tolist()
    before = per_rank[: reducers.rank].sum(0).tolist()
    exact_max = [s.exact_max for s in sketches]
    small = [totals[i] <= exact_max[i] for i in range(len(sketches))]
    sizes = [totals[i] if small[i] else sketches[i].layout.size + 1 for i in range(len(sketches))]
    counted = {i: _counted(sketches[i]) if sketches[i].exact else sketches[i]
               for i in range(len(sketches)) if not small[i]}  # a rank's few values, counted: the window is large
    buffer = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    offset = 0
    for i, s in enumerate(sketches):
        part = buffer[offset: offset + sizes[i]]
        if small[i]:
            part[before[i]: before[i] + s.n] = s.exact_values().to(device)
        elif s.n:
            part[:-1] = counted[i].counts.to(device=device, dtype=torch.float64)
            part[-1] = counted[i].total.to(device)
        offset += sizes[i]
    buffer = reducers.sum(buffer)
    large = [i for i in range(len(sketches)) if not small[i]]
    extremes = None
    if large:
        ext = torch.full((2 * len(large),), -math.inf, dtype=torch.float64, device=device)
        for j, i in enumerate(large):
            if sketches[i].n:
                ext[2 * j], ext[2 * j + 1] = counted[i].high.to(device), -counted[i].low.to(device)
        extremes = reducers.max(ext).cpu()
    out, offset = [], 0
    for i, s in enumerate(sketches):
        part = buffer[offset: offset + sizes[i]]
        offset += sizes[i]
        r = ValueSketch(s.layout, s.exact_max)
        r.device, r.n = device, int(totals[i])
        if small[i]:
            r.values = [part]
        else:
            j = large.index(i)
            r.values = None
            r.counts = part[:-1].round().to(torch.int64)
            r.total = part[-1]
            r.high, r.low = extremes[2 * j], -extremes[2 * j + 1]
        out.append(r)
    return out


def _counted(s: ValueSketch) -> ValueSketch:
    """A copy of ``s`` holding counts instead of values (``s`` unchanged)."""
    c = ValueSketch(s.layout, 0)
    c.device = s.device
    for v in s.values or []:
        c.add(v)
    if c.counts is None:
        c._to_counts()
    return c
