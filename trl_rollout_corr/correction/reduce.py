"""The reduction engine: per-row (B,) values and their reductions, evaluated together in a few batched ops.

Generic: it knows nothing of IS or RS. A family registers (B,) row vectors with ``RowTable.add(name, values,
*kinds, gt=, lt=, bucket=)``; ``RowTable.reduce(layout)`` returns the ``CorrectionStats`` of every registration.

* Reductions over valid rows (rows with at least one valid token): ``Kind.SUM``, ``Kind.SQ`` (sum of squares),
  ``Kind.WSUM``/``Kind.WSQ`` (weighted by the row's valid-token count), ``Kind.MAX``/``Kind.MIN``;
  ``Kind.SUM_ALL`` sums over every row. Stored names follow ``stats.stat_name``.
* ``gt=(count_name, threshold)`` / ``lt=(...)`` count the valid rows whose value is above / below a threshold
  (a NaN value is never counted), stored as ``count_name``.
* ``bucket=True`` also sums the value over the valid rows of each response-length bucket (``name@j``).
* ``add_sq(name, (M2, mean))`` registers an exact sum of squares ``M2 + n mean^2`` (see ``Workspace.row_moments``).

All sums come from one matrix product ``[V; V*V; hits; X_all] @ [valid, n, 1, buckets, n*buckets]`` (V: the
values with invalid rows zeroed) and one gather; maxima/minima from one masked amax/amin each. The bookkeeping
(names, gather indices, thresholds) depends only on the sequence of registrations and the value dtypes, and is
built once per sequence (``ReducePlan``, cached in ``_PLANS``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from .stats import CorrectionStats, Kind, stat_name


class _Registration(NamedTuple):
    name: str
    kinds: tuple[Kind, ...]
    gt: Optional[tuple[str, float]]
    lt: Optional[tuple[str, float]]
    bucket: bool
    plus_wsq: Optional[int]  # index of a row-mean vector m whose sum_i n_i m_i^2 is added to this value's sums


class RowTable:
    """Row vectors of one correction call and the reductions each needs.

    Args:
        n_row: (B,) float64 valid tokens per row (a row is valid when it is > 0; also the WSUM weight).
        bucket_edges: increasing response-length edges (valid tokens per row); ``()`` for no buckets.
    """

    def __init__(self, n_row: torch.Tensor, bucket_edges: tuple[int, ...] = ()) -> None:
        self.values: list[torch.Tensor] = []
        self.signature: list[tuple] = []  # _Registration fields, per add
        self.n = n_row
        self.bucket_edges = bucket_edges

    def add(self, name: str, values: torch.Tensor, *kinds: Kind, gt: Optional[tuple[str, float]] = None,
            lt: Optional[tuple[str, float]] = None, bucket: bool = False, plus_wsq: Optional[int] = None) -> int:
        """Register a (B,) row vector (any float or bool dtype; reduced in float64); returns its index."""
        idx = len(self.values)
        self.values.append(values)
        self.signature.append((name, kinds, gt, lt, bucket, plus_wsq))  # a plain tuple: built on every call
        return idx

    def add_sq(self, name: str, sq: tuple[torch.Tensor, torch.Tensor], bucket: bool = False) -> None:
        """Register the exact row sums of squares ``(M2, row mean)`` from ``Workspace.row_moments`` as the sum
        of squares of ``name`` (read with ``StatView.sq(name)``)."""
        m2, mean = sq
        self.add(stat_name(name, Kind.SQ), m2, Kind.SUM, bucket=bucket, plus_wsq=self.add(name + "_rowmean", mean))

    def reduce(self, layout) -> CorrectionStats:
        """Evaluate every registration; returns ``CorrectionStats`` carrying ``layout``."""
        dtypes = tuple(v.dtype for v in self.values)
        key = (tuple(self.signature), dtypes, self.bucket_edges)
        if torch.compiler.is_compiling():  # static at trace time; a cache lookup would only add guards
            plan = ReducePlan(self.signature, dtypes, self.bucket_edges)
        else:
            plan = _PLANS.get(key)
            if plan is None:
                plan = _PLANS[key] = ReducePlan(self.signature, dtypes, self.bucket_edges)
        return plan.run(self.values, self.n, layout)


# Columns of the product's right-hand side W: valid, n, one, then (with buckets) in-bucket, n * in-bucket.
_COL_VALID, _COL_N, _COL_ONE, _COL_BUCKETS = 0, 1, 2, 3


class ReducePlan:
    """Names and gather indices for ``RowTable.reduce``, built once per sequence of registrations.

    The left-hand side of the product stacks, in this order: the K values V (grouped by dtype, so each group
    is one same-dtype stack), their squares V*V, the threshold hits, and the raw values of ``SUM_ALL``
    registrations. ``gather[i]`` is the flat (row, column) index of the i-th stored sum.
    """

    def __init__(self, signature: Sequence[tuple], dtypes: Sequence[torch.dtype],
                 bucket_edges: tuple[int, ...]) -> None:
        signature = [_Registration(*reg) for reg in signature]
        self.groups = [[i for i, d in enumerate(dtypes) if d == dt] for dt in dict.fromkeys(dtypes)]
        self.pos = {i: r for r, i in enumerate(i for g in self.groups for i in g)}  # value i -> row of X
        self.bucket_edges = bucket_edges
        self.num_buckets = len(bucket_edges) + 1 if bucket_edges else 0
        self.width = 3 + 2 * self.num_buckets
        hits = [(reg.gt[0], i, reg.gt[1], 1.0) for i, reg in enumerate(signature) if reg.gt is not None]
        hits += [(reg.lt[0], i, reg.lt[1], -1.0) for i, reg in enumerate(signature) if reg.lt is not None]
        alls = [i for i, reg in enumerate(signature) if Kind.SUM_ALL in reg.kinds]
        self.hit_idx = [self.pos[i] for _, i, _, _ in hits]
        self.hit_thr = [thr * sign for _, _, thr, sign in hits]  # x > t  <=>  sign * x > sign * t
        self.hit_sign = [sign for *_, sign in hits]
        self.all_idx = [self.pos[i] for i in alls]
        K = len(signature)
        self.row_sq, self.row_hit, self.row_all = K, 2 * K, 2 * K + len(hits)
        names, gather, self.extra_dst, self.extra_src = [], [], [], []
        self._plan_sums(signature, alls, names, gather)
        self._plan_buckets(signature, names, gather)
        for h, (count_name, *_rest) in enumerate(hits):
            names.append(count_name)
            gather.append(self._flat(self.row_hit + h, _COL_VALID))
        self.sum_names, self.gather = tuple(names), gather
        max_i = [i for i, reg in enumerate(signature) if Kind.MAX in reg.kinds]
        min_i = [i for i, reg in enumerate(signature) if Kind.MIN in reg.kinds]
        self.max_names = tuple(stat_name(signature[i].name, Kind.MAX) for i in max_i)
        self.min_names = tuple(stat_name(signature[i].name, Kind.MIN) for i in min_i)
        self.max_idx, self.min_idx = [self.pos[i] for i in max_i], [self.pos[i] for i in min_i]
        self._dev: dict = {}

    def _flat(self, row: int, col: int) -> int:
        return row * self.width + col

    def _plan_sums(self, signature, alls, names: list, gather: list) -> None:
        """Sums in kind order (SUM, SUM_ALL, SQ, WSUM, WSQ); an ``add_sq`` term lands on its SUM entry."""
        order = {kind: [] for kind in (Kind.SUM, Kind.SUM_ALL, Kind.SQ, Kind.WSUM, Kind.WSQ)}
        for i, reg in enumerate(signature):
            row = self.pos[i]
            for kind in reg.kinds:
                if kind is Kind.SUM:
                    order[kind].append((reg.name, self._flat(row, _COL_VALID)))
                    if reg.plus_wsq is not None:
                        self.extra_dst.append(len(order[Kind.SUM]) - 1)  # SUM entries come first, in this order
                        self.extra_src.append(self._flat(self.row_sq + self.pos[reg.plus_wsq], _COL_N))
                elif kind is Kind.WSUM:
                    order[kind].append((reg.name, self._flat(row, _COL_N)))
                elif kind is Kind.SQ:
                    order[kind].append((stat_name(reg.name, kind), self._flat(self.row_sq + row, _COL_VALID)))
                elif kind is Kind.WSQ:
                    order[kind].append((stat_name(reg.name, kind), self._flat(self.row_sq + row, _COL_N)))
                elif kind is Kind.SUM_ALL:
                    order[kind].append((reg.name, self._flat(self.row_all + alls.index(i), _COL_ONE)))
        for entries in order.values():
            for name, g in entries:
                names.append(name)
                gather.append(g)

    def _plan_buckets(self, signature, names: list, gather: list) -> None:
        nb = self.num_buckets
        for i, reg in enumerate(signature):
            if not (reg.bucket and nb):
                continue
            for j in range(nb):
                if reg.plus_wsq is not None:
                    self.extra_dst.append(len(names))
                    self.extra_src.append(self._flat(self.row_sq + self.pos[reg.plus_wsq], _COL_BUCKETS + nb + j))
                names.append(stat_name(reg.name, Kind.SUM, j))
                gather.append(self._flat(self.pos[i], _COL_BUCKETS + j))

    def _tensors(self, device: torch.device) -> tuple:
        t = self._dev.get(device)
        if t is None:
            f64 = dict(dtype=torch.float64, device=device)
            long = dict(dtype=torch.long, device=device)
            t = self._dev[device] = (
                torch.tensor(self.gather, **long), torch.tensor(self.hit_idx, **long),
                torch.tensor(self.hit_thr, **f64).unsqueeze(-1), torch.tensor(self.hit_sign, **f64).unsqueeze(-1),
                torch.tensor(self.all_idx, **long), torch.tensor(self.max_idx, **long),
                torch.tensor(self.min_idx, **long), torch.tensor(self.bucket_edges, **f64),
                torch.arange(len(self.bucket_edges) + 1, **long),
                torch.tensor(self.extra_dst, **long), torch.tensor(self.extra_src, **long),
            )
        return t

    def run(self, values: list[torch.Tensor], n: torch.Tensor, layout) -> CorrectionStats:
        """Stack the values, one product + gather for the sums, masked amax/amin for the extrema."""
        (gather, hit_idx, hit_thr, hit_sign, all_idx, max_idx, min_idx, edges, bucket_ids, extra_dst,
         extra_src) = self._tensors(n.device)
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
        W = torch.stack([row_valid.double(), n, torch.ones_like(n)], -1)  # (B, 3)
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
