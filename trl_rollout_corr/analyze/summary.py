"""The what-if tables' rows, and ``analyse_dump``: the check and the what-ifs of one dump (``analyze``)."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from ..accumulator import PREFIX
from ..records import RecordsError, RolloutDump, Window
from .check import DEFAULT_TOLERANCE, CheckResult, check_against_logs, check_length_edges, check_tolerance
from .configs import ConfigError, NamedConfig, check_recomputable
from .recompute import Analysis, Recomputer
from .rows import Counts, Part, check_config_fits


# ---------------------------------------------------------------------------------------------- summaries
def summary_row(part: Part) -> dict[str, float]:
    """The what-if table's columns for a ``Part``: kept tokens and rows (fractions), ESS (None without IS), kl,
    k3_kl (nats per token over the valid tokens, as logged), kept_kl, kept_k3 (over the kept tokens), valid tokens
    and rows; None / NaN where no correction ran (e.g. a decoupled window that
    only reused an earlier generation batch)."""
    m = part.metrics() if part.stats is not None else {}
    ess = m.get(f"{PREFIX}rollout_is_eff_sample_size")
    return {
        "kept_tokens": part.counts.kept_token_fraction,
        "kept_rows": part.counts.kept_row_fraction,
        "ess": ess,
        "kl": m.get(f"{PREFIX}kl", math.nan),
        "k3_kl": m.get(f"{PREFIX}k3_kl", math.nan),
        "kept_kl": part.counts.kept_kl,
        "kept_k3": part.counts.kept_k3,
        "valid_tokens": part.counts.valid_tokens,
        "valid_rows": part.counts.valid_rows,
    }


def length_slices(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per length bucket of the merged total: the bucket, its rows, kept fractions, ESS, kl, k3_kl (valid
    tokens) and kept_k3 (kept tokens)."""
    edges = analysis.length_buckets
    bounds = (0, *edges, math.inf)
    m = analysis.total.metrics()
    out = []
    for j in range(len(edges) + 1):
        lo, hi = bounds[j], bounds[j + 1]
        prefix = f"{PREFIX}len_{lo}_{'inf' if hi == math.inf else hi}/"
        counts = analysis.total.counts_by_length.get(j, Counts())
        out.append({"bucket": f"[{lo}, {hi})", "rows": counts.valid_rows, "kept_tokens": counts.kept_token_fraction,
                    "kept_rows": counts.kept_row_fraction, "ess": m.get(prefix + "is_eff_sample_size"),
                    "kl": m.get(prefix + "kl", math.nan), "k3_kl": m.get(prefix + "k3_kl", math.nan),
                    "kept_k3": counts.kept_k3})
    return out


def analysable_windows(dump: RolloutDump, steps: Optional[tuple[int, int]] = None) -> list[Window]:
    """The logged windows of ``dump`` in ``steps`` (inclusive; all when None), after refusing dumps whose metrics
    cannot be recomputed.

    Raises:
        ConfigError: a run trained with M2PO (``check_recomputable``). RecordsError: no stored rows there.
    """
    check_recomputable(dump.correction_config(), f"{dump.path} (the run's training config)")
    windows = [w for w in dump.windows if steps is None or steps[0] <= w.logged_step <= steps[1]]
    if not any(w.files for w in windows):
        raise RecordsError(f"{dump.path}: no stored rows in the selected steps ({len(windows)} logged steps, "
                           "none with a step file). Check --steps, or rollout_dump_every of the run.")
    return windows


def refuse_cut_generations(dump: RolloutDump, windows: Sequence[Window], incomplete: set[int],
                           steps: tuple[int, int]) -> None:
    """Refuse a ``--steps`` range that cuts a generation batch: the correction's statistics (RS, batch
    normalisation, group baselines) are per generation batch, so such a batch cannot be recomputed from part of its
    rows (it was skipped, and with every batch cut nothing was compared: exit 1 with "NO VALUES COMPARED").

    Args:
        dump: the open dump. windows: the selected windows. incomplete: generation batches with fewer rows than a
            full one in the selection (``Recomputer.incomplete``). steps: the selected (first, last) logged steps.

    Raises:
        ConfigError: naming the cut batch, the logged steps outside the range that hold the rest of its rows, and a
            range that covers it. Batches incomplete in the whole dump (``rollout_dump_every``, the run's last
            steps) are not refused: the check skips them and says why.
    """
    if not incomplete:
        return
    import pyarrow.parquet as pq

    selected = {w.logged_step for w in windows}
    outside: dict[int, list[int]] = {}
    for w in dump.windows:
        if w.logged_step in selected or not w.files:
            continue
        for path in w.files:
            batches = set(pq.read_table(path, columns=["generation_batch"]).column(0).to_pylist())
            for batch in batches & incomplete:
                outside.setdefault(batch, []).append(w.logged_step)
    if outside:
        batch = min(outside)
        logged = sorted(set(outside[batch]))
        first, last = min([*logged, *selected]), max([*logged, *selected])
        shown = "" if steps[1] >= 10**12 else steps[1]
        raise ConfigError(
            f"--steps {steps[0]}:{shown} cuts generation batch {batch}: the rest of its rows were trained in logged "
            f"step(s) {', '.join(map(str, logged))}, outside the range, and the correction's statistics are per "
            f"generation batch. Select whole generation batches, e.g. --steps {first}:{last}."
        )


def analyse_dump(dump: RolloutDump, configs: Sequence[NamedConfig], *, length_buckets: Optional[Sequence[int]] = None,
                 steps: Optional[tuple[int, int]] = None,
                 tolerance: float = DEFAULT_TOLERANCE) -> tuple[CheckResult, list[Analysis], Recomputer]:
    """The check of the training config against the logs, and the what-if analyses.

    Args:
        dump: an open dump. configs: what-if configs (the training config is always analysed first, as "trained").
        length_buckets: slice edges for the what-if tables (default: the trainer's). steps: (first, last) logged
            steps to analyse (inclusive; default all). tolerance: of the check.

    Returns:
        (check, [trained analysis, what-if analyses...], the recomputer).

    Raises:
        RecordsError: an invalid dump (see ``records``). ConfigError: a config the dump cannot serve, length
            buckets that are not increasing positive ints, or a tolerance that is not a finite number >= 0
            (checked before any work).
    """
    tolerance = check_tolerance(tolerance)
    if length_buckets is not None:
        length_buckets = check_length_edges(length_buckets)
    windows = analysable_windows(dump, steps)
    recomputer = Recomputer(dump, windows)
    if steps is not None:
        refuse_cut_generations(dump, windows, recomputer.incomplete, steps)
    trained = NamedConfig("trained", dump.correction_config())
    for named in configs:  # fail before any work on a config the dump cannot serve
        check_config_fits(recomputer.rows, named, dump)
    check = check_against_logs(recomputer.analyse(trained, dump.length_buckets), recomputer, tolerance)
    edges = tuple(length_buckets) if length_buckets is not None else dump.length_buckets
    analyses = [recomputer.analyse(named, edges) for named in [trained, *configs]]
    return check, analyses, recomputer
