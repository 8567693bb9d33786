"""The statistics every family reads: valid tokens, valid rows and masked tokens.

They are the denominators of every ``rollout_corr/*`` metric; their own metrics are ``num_valid_tokens``,
``num_valid_seqs`` and ``invalid_token_fraction`` (masked tokens whose log-prob is NaN/inf, over masked tokens).
A token is valid when its mask is > 0 and both log-probs are finite; a row is valid when it has a valid token.
"""

from __future__ import annotations

from .reduce import RowTable
from .stats import Kind, StatView
from .workspace import Workspace

N_TOK = "n_tok"  # valid tokens (also per length bucket)
N_SEQ = "n_seq"  # valid rows (also per length bucket)
N_MASKED = "n_masked"  # tokens with mask > 0, valid or not


def collect(ws: Workspace, rows: RowTable) -> None:
    """Register the counts (valid tokens and rows also per length bucket)."""
    rows.add(N_MASKED, ws.n_masked, Kind.SUM_ALL)
    rows.add(N_TOK, ws.n_row, Kind.SUM, bucket=True)
    rows.add(N_SEQ, ws.row_valid, Kind.SUM, bucket=True)


def finalize(v: StatView) -> dict[str, float]:
    """``num_valid_tokens``, ``num_valid_seqs``, and ``invalid_token_fraction`` (absent without a masked token)."""
    n_tok, n_masked = v.sum(N_TOK), v.sum(N_MASKED)
    out = {"num_valid_tokens": n_tok, "num_valid_seqs": v.sum(N_SEQ)}
    if n_masked > 0:
        out["invalid_token_fraction"] = (n_masked - n_tok) / n_masked
    return out
