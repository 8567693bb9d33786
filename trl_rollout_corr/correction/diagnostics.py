"""Off-policy diagnostics: always computed, whatever IS/RS is configured (verl's ``compute_offpolicy_metrics``).

With ``l = log pi_train - log mu`` (nats), ``x = clamp(l, -20, 20)``, N valid tokens, V valid rows and ``S_i`` the
sum of l over the valid tokens of row i: ``kl = -sum l / N`` (k1 estimate of KL(mu || pi_train)); ``k3_kl =
sum(exp(x) - 1 - x) / N``; ``chi2_token = sum exp(2x) / N - 1``; ``chi2_seq = mean_V exp(2 clamp(S_i)) - 1``;
``training_log_ppl = mean_V(-mean_t log pi_train)``, ``training_ppl = mean_V exp(...)``, the same for
``rollout_*``; ``log_ppl_diff = mean_V d_i`` with ``d_i = mean_t(log mu - log pi_train)``, ``log_ppl_abs_diff``,
``log_ppl_diff_max/min``, ``ppl_ratio = mean_V exp(d_i)``. Per-row means run over valid rows only (deliberate
difference: verl averages all B rows, padding rows included). Length slices: ``len_{lo}_{hi}/kl``, ``k3_kl``,
``num_seqs`` over the rows whose valid-token count is in ``[lo, hi)``.
"""

from __future__ import annotations

import torch

from . import counts
from .reduce import RowTable
from .stats import EXP_CAP, Kind, StatView, div, max_or_zero, min_or_zero
from .workspace import SAFETY_BOUND, Workspace

L = "l"  # row sums of l (also per length bucket)
K3 = "k3"  # row sums of k3 (also per length bucket)
TRAIN_LOG_PPL, TRAIN_PPL, ROLL_LOG_PPL, ROLL_PPL = "train_log_ppl", "train_ppl", "roll_log_ppl", "roll_ppl"
D, ABS_D, EXP_D = "d", "abs_d", "exp_d"  # per-row mean(log mu - log pi_train), its abs and exp
SEQ_R2 = "seq_r2"  # per-row exp(2 clamp(S_i))
R2 = "r2"  # per-row sums of R^2 = n + 2 sum E + sum E^2 (E = R - 1 keeps chi2 exact when R ~ 1)


def collect(ws: Workspace, rows: RowTable) -> None:
    """Register the per-row statistics of the off-policy diagnostics."""
    rows.add(L, ws.seq_l, Kind.SUM, bucket=True)
    rows.add(K3, ws.k3_row, Kind.SUM, bucket=True)  # k3 is 0 outside valid tokens
    n1 = ws.n1_64
    mean_roll = ws.rollout_row_sum.double() / n1  # mean log mu per row
    mean_train = ws.train_row_sum.double() / n1  # mean log pi_train per row
    d = -ws.seq_l / n1  # mean(log mu - log pi_train) per row
    rows.add(TRAIN_LOG_PPL, -mean_train, Kind.SUM)
    rows.add(TRAIN_PPL, torch.exp((-mean_train).clamp(max=EXP_CAP)), Kind.SUM)
    rows.add(ROLL_LOG_PPL, -mean_roll, Kind.SUM)
    rows.add(ROLL_PPL, torch.exp((-mean_roll).clamp(max=EXP_CAP)), Kind.SUM)
    rows.add(D, d, Kind.SUM, Kind.MAX, Kind.MIN)
    rows.add(ABS_D, d.abs(), Kind.SUM)
    rows.add(EXP_D, torch.exp(d.clamp(max=EXP_CAP)), Kind.SUM)
    rows.add(SEQ_R2, torch.exp(2.0 * ws.seq_l.clamp(-SAFETY_BOUND, SAFETY_BOUND)), Kind.SUM)
    rows.add(R2, ws.n_row64 + 2.0 * ws.e_row + ws.e2_row, Kind.SUM)


def finalize(v: StatView, n_tok: float, n_seq: float) -> dict[str, float]:
    """The off-policy metrics (verl's names and order)."""
    return {
        "training_ppl": div(v.sum(TRAIN_PPL), n_seq),
        "training_log_ppl": div(v.sum(TRAIN_LOG_PPL), n_seq),
        "kl": -div(v.sum(L), n_tok),
        "k3_kl": div(v.sum(K3), n_tok),
        "rollout_ppl": div(v.sum(ROLL_PPL), n_seq),
        "rollout_log_ppl": div(v.sum(ROLL_LOG_PPL), n_seq),
        "log_ppl_diff": div(v.sum(D), n_seq),
        "log_ppl_abs_diff": div(v.sum(ABS_D), n_seq),
        "log_ppl_diff_max": max_or_zero(v.max(D)),
        "log_ppl_diff_min": min_or_zero(v.min(D)),
        "ppl_ratio": div(v.sum(EXP_D), n_seq),
        "chi2_token": div(v.sum(R2), n_tok) - 1.0 if n_tok > 0 else 0.0,
        "chi2_seq": div(v.sum(SEQ_R2), n_seq) - 1.0 if n_seq > 0 else 0.0,
    }


def finalize_bucket(v: StatView, j: int, n_j: float) -> dict[str, float]:
    """``num_seqs``, ``kl``, ``k3_kl`` of length bucket ``j`` (n_j valid tokens)."""
    return {"num_seqs": v.sum(counts.N_SEQ, j), "kl": -div(v.sum(L, j), n_j), "k3_kl": div(v.sum(K3, j), n_j)}
