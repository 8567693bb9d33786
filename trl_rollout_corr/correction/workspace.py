"""The cleaned per-token inputs every family reads, and the shared work buffers, built once per call.

``prepare`` turns ``(log_probs, rollout_log_probs, response_mask)`` into a ``Workspace``: the valid-token mask,
the clamped log ratio ``x``, the ratio ``R``, row counts and row sums, and, up front, every derived quantity a
later step may need (k2/k3 per token, row sums of k1/k2/k3, the extrema of ``x``), chosen by the layout's
``Needs``. After ``prepare`` nothing in the workspace is filled in lazily, so the families can run in any order.

Buffers. ``scratch`` and ``spare()`` are (B, T) float32 temporaries: any function may overwrite them, and no
value is kept in them across function calls. ``take_spare()`` and ``take_ratio()`` hand a buffer over for good
(the caller may then write it in place); reading a taken ratio raises. Masks are float32 0/1, never bool (why,
and the precision scheme of the row sums: ``docs/explanation/correction-internals.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .binary_kl import binary_kl_both

SAFETY_BOUND = 20.0  # |log ratio| clamp before exponentiation, in nats (as verl)
_BIG = 1e30  # float32 stand-in for +-inf in masked extrema (|x| <= 20, so x +- _BIG never rounds back to x)


@dataclass(frozen=True)
class Needs:
    """Which derived per-token quantities ``prepare`` computes (from the correction layout, once per config).

    Attributes:
        x_range: row max/min of x (token TIS reports W extrema through them; token k1 reports its extrema).
        k2_tokens: the (B, T) k2 tensor (any k2 option).
        k3_tokens: the (B, T) k3 tensor (token-level k3 or ``seq_max_k3``); k3 row sums are always computed.
        k1_row_sum: row sums of x (any k1 option).
        k2_row_sum: row sums of k2 (a k2 option other than ``seq_max``).
        binary_kl_tokens: the (B, T) float64 KPop statistic and its row sums (``token_binary_kl``).
    """

    x_range: bool = False
    k2_tokens: bool = False
    k3_tokens: bool = False
    k1_row_sum: bool = False
    k2_row_sum: bool = False
    binary_kl_tokens: bool = False


@dataclass
class Workspace:
    """Cleaned per-token quantities shared by IS, RS and the diagnostics ((B, T) float32 unless noted).

    Attributes:
        response_mask: the caller's mask (any dtype; > 0 means completion token).
        valid: 1.0 at valid tokens (mask > 0 and finite log ratio), else 0.0.
        x: ``clamp(l, -20, 20)`` at valid tokens, 0 elsewhere (l = log pi_train - log mu, nats).
        n_row: (B,) float32 valid tokens per row; ``n_row64`` the same in float64; ``row_valid`` (B,) bool.
        n1, n1_64: (B,) ``max(n_row, 1)`` in float32 / float64.
        n_masked: (B,) float32 tokens with mask > 0 per row (valid + invalid).
        seq_l: (B,) float64 sum of l over valid tokens (unclamped).
        train_row_sum, rollout_row_sum: (B,) float32 sums of log pi_train / log mu over valid tokens.
        e_row, e2_row, k3_row: (B,) float64 sums of ``E = expm1(x) = R - 1``, of ``E^2`` and of ``k3 = E - x``.
        k2_tokens, k3_tokens: (B, T) k2 / k3 (0 off valid), or None when not needed.
        k1_row_sum, k2_row_sum: (B,) float64 row sums of k1 (``-sum x``) / k2, or None.
        x_max_rows, x_min_rows: (B,) max/min of x over valid tokens (+-_BIG on rows without one), or None.
        binary_kl_tokens: (B, T) float64 ``max(KL(Ber(p) || Ber(q)), KL(Ber(q) || Ber(p)))`` of the sampled token
            (p = pi_train, q = mu; ``correction.binary_kl``), 0 off valid, or None; ``binary_kl_row_sum`` its (B,)
            row sums.
        exact_inputs: both log-prob inputs are float64 (l, E and k3 are formed in float64).
        scratch: a (B, T) float32 temporary (see the module docstring).
    """

    response_mask: torch.Tensor
    valid: torch.Tensor
    x: torch.Tensor
    n_row: torch.Tensor
    n_row64: torch.Tensor
    row_valid: torch.Tensor
    n1: torch.Tensor
    n1_64: torch.Tensor
    n_masked: torch.Tensor
    seq_l: torch.Tensor
    train_row_sum: torch.Tensor
    rollout_row_sum: torch.Tensor
    exact_inputs: bool
    scratch: torch.Tensor
    _ratio: Optional[torch.Tensor]
    e_row: Optional[torch.Tensor] = None
    e2_row: Optional[torch.Tensor] = None
    k3_row: Optional[torch.Tensor] = None
    k2_tokens: Optional[torch.Tensor] = None
    k3_tokens: Optional[torch.Tensor] = None
    k1_row_sum: Optional[torch.Tensor] = None
    k2_row_sum: Optional[torch.Tensor] = None
    x_max_rows: Optional[torch.Tensor] = None
    x_min_rows: Optional[torch.Tensor] = None
    binary_kl_tokens: Optional[torch.Tensor] = None
    binary_kl_row_sum: Optional[torch.Tensor] = None
    _spare: Optional[torch.Tensor] = None

    # -------------------------------------------------------------- buffers
    def spare(self) -> torch.Tensor:
        """A second (B, T) float32 temporary, allocated on first use."""
        if self._spare is None:
            self._spare = torch.empty_like(self.x)
        return self._spare

    def take_spare(self) -> torch.Tensor:
        """The spare buffer, handed over for good (e.g. to become the returned mask); a fresh one next time."""
        buf, self._spare = self.spare(), None
        return buf

    @property
    def ratio(self) -> torch.Tensor:
        """``R = exp(x)`` at valid tokens, 0 elsewhere (read-only view until taken).

        Raises:
            RuntimeError: after ``take_ratio()``.
        """
        if self._ratio is None:
            raise RuntimeError("the ratio buffer was taken (take_ratio) and may have been modified in place")
        return self._ratio

    def take_ratio(self) -> torch.Tensor:
        """``R``, handed over for good: the caller may clamp it in place (TIS does)."""
        ratio, self._ratio = self.ratio, None
        return ratio

    def token_stat(self, stat: str) -> torch.Tensor:
        """The (B, T) k2, k3 or binary-KL tensor (k1 = -x is never materialised)."""
        t = {"k2": self.k2_tokens, "k3": self.k3_tokens, "binary_kl": self.binary_kl_tokens}[stat]
        assert t is not None, f"{stat} tokens were not prepared (layout Needs)"
        return t

    def stat_row_sum(self, stat: str) -> torch.Tensor:
        """(B,) float64 row sums of k1, k2, k3 or the binary KL over valid tokens."""
        t = {"k1": self.k1_row_sum, "k2": self.k2_row_sum, "k3": self.k3_row,
             "binary_kl": self.binary_kl_row_sum}[stat]
        assert t is not None, f"{stat} row sums were not prepared (layout Needs)"
        return t

    # -------------------------------------------------------------- row statistics of a zero-off-valid tensor
    def row_moments(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Exact per-row sum and sum of squares of a zero-off-valid (B, T) float32 ``t``.

        Returns:
            ``(S, (M2, m))``: ``S`` (B,) float64 row sums, ``m = S / n`` (float64 row means) and ``M2`` (B,) the
            float32 sum over valid tokens of ``(t - c)^2`` around the float32 row mean ``c``, so that
            ``sum t^2 = M2 + n m^2`` (``RowTable.add_sq`` adds the two). Uses ``scratch``.

        A compensated two-pass: ``S = n c + sum(t - c)`` recovers the float32 row sum's rounding, and the
        variance ``E[t^2] - E[t]^2`` stays exact when every t is ~1 +- 1e-4 (see the internals note).
        """
        s32 = t.sum(-1)
        c = torch.div(s32, self.n1)
        compiling = torch.compiler.is_compiling()
        d = torch.addcmul(t, self.valid, c.unsqueeze(-1), value=-1.0, out=None if compiling else self.scratch)
        ds = d.sum(-1)
        m2 = (d * d).sum(-1) if compiling else d.square_().sum(-1)
        s64 = torch.addcmul(ds.double(), c.double(), self.n_row64)
        return s64, (m2, s64 / self.n1_64)

    def valid_min_rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) min over valid tokens of a zero-off-valid float32 t (+_BIG on rows without one, never read).

        Uses ``scratch``."""
        return torch.mul(self.valid, -_BIG, out=self.scratch).add_(_BIG).add_(t).amin(-1)


# ---------------------------------------------------------------------- helpers with an eager and a compiled body
def host_checks_allowed(t: torch.Tensor) -> bool:
    """Whether a data-dependent host check on ``t`` is free: CPU tensors outside ``torch.compile`` (on an
    accelerator it would be a device sync; under compile a graph break)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def mask_float(response_mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``response_mask > 0`` as float32 0/1 written into ``out`` (bool masks: read through uint8)."""
    if response_mask.dtype == torch.bool:
        return out.copy_(response_mask.view(torch.uint8))
    return torch.gt(response_mask, 0, out=out)


def masked_zero(t: torch.Tensor, valid: torch.Tensor, out: torch.Tensor, all_finite: bool = False) -> torch.Tensor:
    """``t`` at valid tokens, 0 elsewhere (``t`` may hold NaN/inf off-valid, unless ``all_finite``).

    Eager: one multiply when every entry is known finite, else nan_to_num then multiply (into ``out``).
    Compiled: ``where`` (inductor's CPU nan_to_num falls back to scalar code; ``where`` is vectorised)."""
    if torch.compiler.is_compiling():
        return torch.where(valid > 0, t, 0.0)
    if all_finite:
        return torch.mul(t, valid, out=out)
    return torch.nan_to_num(t, 0.0, 0.0, 0.0, out=out).mul_(valid)


def k3_float64(x: torch.Tensor) -> torch.Tensor:
    """k3 = expm1(x) - x in float64, for float64 inputs, whose log ratios are known far better than float32's
    expm1 (~6e-8 relative) can render k3 ~ x^2 / 2 when |x| ~ 1e-6."""
    x64 = x.double()
    return torch.expm1(x64).sub_(x64)


def k3_compiled(x: torch.Tensor) -> torch.Tensor:
    """k3 = expm1(x) - x under torch.compile, where inductor's vectorised CPU code lowers expm1 to ``exp(x) - 1``
    (which cancels for small x): the Taylor series sum_{n=2..8} x^n / n! for |x| <= 0.5 (truncation < 4e-8
    relative), ``exp(x) - 1 - x`` beyond (cancellation < 2e-6 relative). Fused, the extra flops are free.
    (The float32 eager path computes k3 as ``E - x`` from E = expm1(x), see ``_expm1_stats``.)"""
    small = x.abs() <= 0.5
    xs = torch.where(small, x, 0.0)
    poly = torch.full_like(xs, 1.0 / 40320.0)
    for n in (7, 6, 5, 4, 3, 2):
        poly = poly * xs + 1.0 / math.factorial(n)
    return torch.where(small, poly * xs * xs, torch.exp(x) - 1.0 - x)


# ---------------------------------------------------------------------- prepare
def prepare(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
            needs: Needs) -> Workspace:
    """Build the workspace of one call (inputs already checked by the entry point).

    Args:
        log_probs, rollout_log_probs: (B, T) pi_train and mu log-probs, nats (bf16/fp16 upcast to float32;
            subtracted in float64 when both are float64).
        response_mask: (B, T), > 0 at completion tokens.
        needs: the derived quantities to compute up front.
    """
    ws = _clean_inputs(log_probs, rollout_log_probs, response_mask)
    _expm1_stats(ws, keep_k3=needs.k3_tokens)
    if needs.x_range:
        _x_range(ws)
    if needs.k2_tokens:
        ws.k2_tokens = torch.mul(ws.x, ws.x).mul_(0.5)
    if needs.k2_row_sum:
        ws.k2_row_sum = ws.k2_tokens.sum(-1).double()  # float64: band edges compare in float64
    if needs.k1_row_sum:
        ws.k1_row_sum = -ws.x.sum(-1).double()
    if needs.binary_kl_tokens:  # from the log-probs themselves (not x): the KL depends on p and q, not only on p/q
        stat = binary_kl_both(log_probs.detach(), rollout_log_probs.detach())
        ws.binary_kl_tokens = torch.where(ws.valid > 0, stat, 0.0)
        ws.binary_kl_row_sum = ws.binary_kl_tokens.sum(-1)
    return ws


def _clean_inputs(log_probs, rollout_log_probs, response_mask) -> Workspace:
    """Valid mask, l (zeroed off valid), x, R, row counts and row sums."""
    lp, rlp = log_probs.detach(), rollout_log_probs.detach()
    work = torch.float64 if lp.dtype == rlp.dtype == torch.float64 else torch.float32
    lp, rlp = lp.to(work), rlp.to(work)
    diff = lp - rlp  # fresh; becomes l (and x in place) for float32 work
    chk = torch.sub(diff, diff)  # 0 where diff is finite, NaN for NaN/+-inf in either input
    valid = mask_float(response_mask, torch.empty(diff.shape, dtype=torch.float32, device=diff.device))
    n_masked = valid.sum(-1)
    finite = torch.eq(chk, 0, out=chk)  # 1.0 where l (so both log-probs) is finite, padding included
    valid.mul_(finite)  # valid = mask > 0 and finite log ratio
    all_finite = host_checks_allowed(diff) and bool(finite.all())  # then zeroing needs no nan_to_num pass
    diff = masked_zero(diff, valid, out=diff, all_finite=all_finite)
    seq_l = diff.sum(-1).double()
    n_row = valid.sum(-1)
    # training / rollout row sums, each summed directly so that an extreme value on one side (an engine's -1e8
    # for a filtered token) cannot swamp the other (chk is a work-dtype temporary here)
    train_row_sum = masked_zero(lp, valid, out=chk, all_finite=all_finite).sum(-1)
    rollout_row_sum = masked_zero(rlp, valid, out=chk, all_finite=all_finite).sum(-1)
    x = (diff if work == torch.float32 else diff.float()).clamp_(-SAFETY_BOUND, SAFETY_BOUND)
    scratch = chk if work == torch.float32 else torch.empty_like(x)
    ratio = torch.exp(x).mul_(valid)
    n1 = n_row.clamp(min=1)
    return Workspace(
        response_mask=response_mask, valid=valid, x=x, n_row=n_row, n_row64=n_row.double(), row_valid=n_row > 0,
        n1=n1, n1_64=n1.double(), n_masked=n_masked, seq_l=seq_l, train_row_sum=train_row_sum,
        rollout_row_sum=rollout_row_sum, exact_inputs=work == torch.float64, scratch=scratch, _ratio=ratio,
    )


def _expm1_stats(ws: Workspace, keep_k3: bool) -> None:
    """Row sums of E = expm1(x) = R - 1, E^2 and k3 = E - x (all 0 off valid); the (B, T) k3 if ``keep_k3``.

    ``sum R = n + sum E`` and ``sum R^2 = n + 2 sum E + sum E^2`` then carry E's relative precision, so chi2
    stays exact when R ~ 1 +- 1e-5; k3 = expm1(x) - x has no cancellation (internals note)."""
    if torch.compiler.is_compiling():
        k3 = k3_compiled(ws.x)
        e = k3 + ws.x
        ws.e_row, ws.e2_row = e.sum(-1).double(), (e * e).sum(-1).double()
    elif ws.exact_inputs:
        k3 = k3_float64(ws.x)
        e = k3 + ws.x.double()
        ws.e_row, ws.e2_row = e.sum(-1).double(), (e * e).sum(-1).double()
    else:
        e = torch.expm1(ws.x, out=None if keep_k3 else ws.scratch)
        ws.e_row, ws.e2_row = e.sum(-1).double(), torch.mul(e, e, out=ws.spare()).sum(-1).double()
        k3 = e.sub_(ws.x)
    ws.k3_row = k3.sum(-1).double()
    ws.k3_tokens = k3 if keep_k3 else None


def _x_range(ws: Workspace) -> None:
    """Row max/min of x over valid tokens: x -/+ _BIG off valid, no where (uses both temporaries)."""
    if ws.x.numel():
        pen = torch.sub(ws.valid, 1.0, out=ws.spare()).mul_(_BIG)
        ws.x_max_rows = torch.add(ws.x, pen, out=ws.scratch).amax(-1)
        ws.x_min_rows = torch.sub(ws.x, pen, out=ws.scratch).amin(-1)
    else:  # T = 0: amax over an empty dim raises; every row is invalid and never read
        ws.x_max_rows = ws.x_min_rows = ws.seq_l
