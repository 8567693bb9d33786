"""The Bernoulli ("binary") KL between two probabilities of the same sampled token, from their log-probs: KPop.

KPop (Ant Group's Ring team, 2026; AReaL's ``kpop``, prime-rl#3283 and verl#6800 propose it) treats the vocabulary as
two events, "the sampled token" and "anything else", and keeps a token iff the Bernoulli KL between the trainer's
probability ``p`` and the rollout engine's ``q`` is at most ``phi`` nats in both directions:

    D(p || q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)),   keep  <=>  max(D(p || q), D(q || p)) <= phi.

Unlike a ratio band (IcePop's ``[0.5, 5]`` on ``p / q``), the band adapts to the probability: near ``p = q`` the KL is
``(p - q)^2 / (2 p (1 - p))``, so rare tokens (1e-4 vs 1e-3: ratio 10, KL ~1e-3) are kept while confident tokens
whose distributions differ (0.99 vs 0.9: ratio 1.1, reverse KL 0.145) are rejected at ``phi = 0.1``.

Numerics (all float64, from ``a = log p`` and ``b = log q`` without forming a ratio of probabilities):

* ``D(p || q) = p k3(b - a) + (1 - p) k3(lb - la)`` with ``k3(y) = e^y - 1 - y >= 0``, ``la = log(1 - p)``,
  ``lb = log(1 - q)``: both terms are non-negative, so there is no cancellation between them (the two-term
  textbook form loses all digits when ``p ~ q``). ``s k3(y)`` is ``s (expm1(y) - y)`` (a Taylor series for
  ``|y| <= 1e-2``) for ``y <= 1`` and ``t - s - s y`` (``t = s e^y``, no overflow) above.
* ``log(1 - e^a)`` is ``log(-expm1(a))`` for ``a > -ln 2`` and ``log1p(-exp(a))`` below (Maechler, 2012), exact to
  rounding near both ends.
* ``p = 1`` exactly (a log-prob of 0: ``1 - p`` underflowed in the producer's arithmetic) would make the KL against
  any ``q < 1`` infinite; ``log(1 - p)`` is floored at ``LOG_ONE_MINUS_P_FLOOR`` (the log of float64's smallest
  normal, ``-708.4``), the largest finite KL consistent with the rounding: both sides exactly 1 give 0, one side
  exactly 1 gives about ``708 (1 - q)`` nats, so the token is kept only if the other side is also confident
  (``1 - q <~ phi / 700``). A log-prob above 0 (rounding) is read as 0.
* ``p`` underflowing (``a < -745``) is exact: the terms are formed from ``a`` and ``b``, not from ``p / q``.
"""

from __future__ import annotations

import math

import torch

LOG_ONE_MINUS_P_FLOOR = math.log(2.0**-1022)  # log(1 - p) for p = 1 exactly (see the module docstring), nats
_SERIES_BELOW = 1e-2  # |y| under which k3(y) = expm1(y) - y is summed as a series (no cancellation)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0`` (nats), floored at ``LOG_ONE_MINUS_P_FLOOR`` (``a = 0``: ``p = 1``).

    Args:
        a: log-probabilities, float64, ``<= 0``.

    Returns:
        Same shape and dtype. Exact to rounding near both ends (``log(-expm1(a))`` above ``-ln 2``, ``log1p(-exp(a))``
        below; Maechler, "Accurately computing log(1 - exp(-|a|))", 2012).
    """
    near_one = a > -math.log(2.0)
    out = torch.where(near_one, torch.log(-torch.expm1(torch.where(near_one, a, -1.0))),
                      torch.log1p(-torch.exp(torch.where(near_one, -1.0, a))))
    return out.clamp_(min=LOG_ONE_MINUS_P_FLOOR)


def _scaled_k3(log_s: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """``s k3(log t - log s) = t - s - s log(t / s) >= 0`` (``s = e^log_s``, ``t = e^log_t``), without overflow."""
    y = log_t - log_s
    s = torch.exp(log_s)
    ys = y.clamp(max=1.0)  # the k3 branch never sees a large y (the other branch is selected there)
    small = ys.abs() <= _SERIES_BELOW
    yy = torch.where(small, ys, 0.0)
    series = torch.full_like(yy, 1.0 / 5040.0)  # sum_{n=2..7} y^n / n! (truncation < 1e-16 relative at |y| = 1e-2)
    for n in (6, 5, 4, 3, 2):
        series = series * yy + 1.0 / math.factorial(n)
    k3 = torch.where(small, series * yy * yy, torch.expm1(ys) - ys)
    return torch.where(y > 1.0, torch.exp(log_t) - s - s * y, s * k3)


def bernoulli_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(Ber(p) || Ber(q)) = p log(p / q) + (1 - p) log((1 - p) / (1 - q))`` in nats, from log-probs.

    Args:
        log_p, log_q: log-probabilities of the same events (any broadcastable shapes), nats; computed in float64.
            Values above 0 are read as 0; -inf / NaN give NaN (the caller masks invalid tokens).

    Returns:
        float64, ``>= 0`` (see the module docstring for ``p = 1`` exactly and for underflow).
    """
    a = log_p.double().clamp(max=0.0)
    b = log_q.double().clamp(max=0.0)
    return _scaled_k3(a, b) + _scaled_k3(log1mexp(a), log1mexp(b))


def binary_kl_both(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KPop's per-token statistic ``max(KL(Ber(p) || Ber(q)), KL(Ber(q) || Ber(p)))``, nats, float64.

    A token is kept at threshold ``phi`` iff this is ``<= phi`` (``<=`` in both directions). Shapes as
    ``bernoulli_kl``; typically (B, T) with ``log_p = log pi_train`` and ``log_q = log mu``.
    """
    a = log_p.double().clamp(max=0.0)
    b = log_q.double().clamp(max=0.0)
    la, lb = log1mexp(a), log1mexp(b)
    forward = _scaled_k3(a, b) + _scaled_k3(la, lb)
    reverse = _scaled_k3(b, a) + _scaled_k3(lb, la)
    return torch.maximum(forward, reverse)
