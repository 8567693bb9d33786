"""``analyze --suggest``: a threshold for every RS and IS option, computed from a run's own rollout records.

For each option the statistic the correction tests is evaluated on the dump exactly as ``analyze`` re-applies a
config (the same rows, grouped as the trainer grouped its correction calls, through the correction's own workspace),
and the threshold is read off its sorted values:

* ``--keep F``: the threshold that keeps the fraction F of the valid tokens (token options: ``token_*``) or of the
  valid rows (sequence options: ``seq_*``); for IS, the TIS cap U that leaves the fraction F of the weights
  untruncated (``R <= U``: tokens for ``rollout_is=token``, rows for ``sequence``);
* ``--quantile Q``: the threshold at the Q-quantile of the same statistic measured on the uses at policy lag 0 only
  (the engine mismatch without staleness), then applied to every lag.

Rule: with n values and k = ceil(F n), k2/k3/binary-KL thresholds are the k-th smallest value itself (kept: the values
``<= threshold``, so exactly k without ties); k1 bands (``[1/u, u]`` on the ratio) and sequence IS caps are compared in
log space after an ``exp``/``log`` round trip, so their threshold sits half-way between the k-th and the (k+1)-th value
of ``|log ratio|``. Ties at the threshold keep them all, and a k2/k3/KL threshold of 0 (identical engines) is raised to
the smallest positive value: the kept fraction reported is always the one the correction gives.

Each suggestion is then re-applied (``Recomputer.analyse``) and reported with its kept tokens and rows, ESS (when the
config has IS weights: a suggested RS option keeps the trained config's IS settings and mode, a suggested IS cap keeps
its RS settings), kl and k3 by policy lag and by response length; a YAML file per option (paste it into the recipe
config, or pass it back with ``analyze --config``: an RS one always writes ``rollout_rs_on``, so that pasted over a
recipe that judges the other ratio it still judges the ratio its threshold was read from) and a figure of kept
fraction against threshold per option.

RS on the engine factor (``rollout_rs_on="engine"``, issue 23): when the dump holds ``version_log_probs`` (log
pi_train@v, records 1.1, written with ``policy_lag_split``) and its rows are decoupled, every RS option also gets a
threshold read, by the same rule, off its statistic on the engine factor ``pi_train@v / mu`` (the workspace the
correction builds for ``rs_log_probs``: over the same valid tokens, a token without a finite pi_train@v is one RS
rejects at any threshold), over the same population (rows over ``max_policy_lag`` left out), re-applied with
``rollout_rs_on: engine``. IS caps have no engine variant (IS weights the whole ratio). ``--quantile`` reads the
lag-0 uses, where the engine factor is the whole ratio, so the threshold equals the direct one; what differs is the
ratio it is applied to at lag > 0. Without the column, or on bypass rows, the engine suggestions are left out with
the reason (``engine_unavailable``), or refused when they were asked for (``engine=True``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .analyze import Analysis, ConfigError, NamedConfig, Recomputer, analysable_windows, length_slices, summary_row
from .config import RolloutCorrectionConfig
from .correction.rejection import RS_OPTION_PARTS, row_values
from .correction.workspace import Needs, prepare
from .records import RolloutDump

IS_OPTIONS = ("is_token", "is_sequence")  # TIS caps (rollout_is = token / sequence)
ENGINE_SUFFIX = "_engine"  # the name (YAML file, table, JSON) of an RS option's suggestion on the engine factor

SUGGEST_OUTPUTS = ("suggest.json", "suggest_kept_vs_threshold.png")
_NEEDS = Needs(x_range=False, k2_tokens=True, k3_tokens=True, k1_row_sum=True, k2_row_sum=True, binary_kl_tokens=True)


def _name(option: str, rs_on: str) -> str:
    """``option``, or ``option + ENGINE_SUFFIX`` when the RS option judges the engine factor."""
    return option + (ENGINE_SUFFIX if rs_on == "engine" else "")


@dataclass
class Statistic:
    """One option's tested statistic over the analysed population.

    Attributes:
        option: an RS option (``RS_OPTIONS``) or ``is_token`` / ``is_sequence``.
        unit: ``"tokens"`` or ``"rows"``.
        values: (n,) float64: k2/k3/binary KL, ``|log ratio|`` of the token / row product / row geometric mean for k1,
            the ratio R (token IS) or the row's log ratio sum (sequence IS).
        lags: (n,) int64 policy lag of each value's row (each use in bypass mode; the first use in decoupled mode).
        rs_on: ``"direct"`` (the correction's own ratio) or ``"engine"`` (the engine factor pi_train@v / mu; +inf
            where RS rejects at any threshold: no finite pi_train@v).
    """

    option: str
    unit: str
    values: torch.Tensor
    lags: torch.Tensor
    rs_on: str = "direct"

    @property
    def log_space(self) -> bool:
        """Thresholds reach the correction through exp/log (k1 bands, sequence IS caps): half-way rule."""
        return self.option.endswith("_k1") or self.option == "is_sequence"


@dataclass
class Suggestion:
    """A threshold for one option and its re-application.

    Attributes:
        option, unit: as ``Statistic``. target: the requested kept fraction (``--keep``) or quantile (``--quantile``).
        population: values the threshold was read from (all, or the lag-0 ones). threshold: as written in the config.
        config: the suggested config. analysis: its re-application over the dump. note: ties, a raised 0, ...
        statistic: the option's statistic over every analysed use (for the figure). rs_on: the ratio the RS
        option judges (``"engine"``: ``rollout_rs_on: engine`` in the config and YAML).
    """

    option: str
    unit: str
    target: float
    population: int
    threshold: float
    config: RolloutCorrectionConfig
    analysis: Analysis
    note: str = ""
    statistic: Optional[Statistic] = None
    rs_on: str = "direct"

    @property
    def name(self) -> str:
        """The option, or ``OPTION_engine`` for a threshold on the engine factor (file name, table row)."""
        return _name(self.option, self.rs_on)

    @property
    def yaml(self) -> dict[str, Any]:
        """The correction fields this suggestion sets (to paste into a recipe config): IS cap: ``rollout_is`` and its
        threshold (the recipe's RS stays, as in the re-application); RS: ``rollout_rs``, its threshold and
        ``rollout_rs_on``, written also when ``direct`` (the default) so that it overrides a recipe's ``engine``."""
        if self.option in IS_OPTIONS:
            return {"rollout_is": self.option.split("_", 1)[1], "rollout_is_threshold": self.threshold}
        return {"rollout_rs": self.option, "rollout_rs_threshold": self.threshold, "rollout_rs_on": self.rs_on}

    def kept(self) -> Optional[float]:
        """The kept fraction the re-application gives, in this option's unit (IS: the untruncated fraction)."""
        m = self.analysis.total.metrics()
        if self.option in IS_OPTIONS:
            high = m.get("rollout_corr/rollout_is_ratio_fraction_high")
            return None if high is None else 1.0 - high
        s = summary_row(self.analysis.total)
        return s["kept_tokens"] if self.unit == "tokens" else s["kept_rows"]


def _policy_column(recomputer: Recomputer, dump: RolloutDump) -> tuple[str, bool]:
    """The pi_train column the suggestions use and whether they are in bypass mode (the trained mode when the dump
    has its column)."""
    rows = recomputer.rows
    trained_bypass = dump.metadata.get("correction", {}).get("mode") == "bypass"
    if rows.has("old_log_probs") and not trained_bypass:
        return "old_log_probs", False
    if rows.has("log_probs"):
        return "log_probs", True
    raise ConfigError(
        f"--suggest needs the trainer's log-probs of the sampled tokens next to the engine's: column 'old_log_probs' "
        f"(pi_old, written by decoupled runs) or 'log_probs' (pi_theta of the loss forward), and {dump.path} has "
        "neither. Re-run the training with rollout_dump_dir set and the decoupled correction (or bypass mode without "
        "the liger loss, which does not expose log-probs), then run --suggest on that dump."
    )


def _groups(recomputer: Recomputer, bypass: bool) -> list[torch.Tensor]:
    """Row indices of each correction call ``Recomputer.analyse`` makes (the same shapes, so the same floats; a
    resumed window's rows before its checkpoint included, as in its total)."""
    if not bypass:
        return [index for batch, index in recomputer.generations.items()
                if recomputer.window_holding_generation(batch) is not None]
    s = recomputer.rows.scalar
    groups = []
    for w in recomputer.windows:
        in_window = s["logged_step"] == w.logged_step
        for micro_step in torch.unique(s["micro_step"][in_window]).tolist():
            groups.append((in_window & (s["micro_step"] == micro_step)).nonzero().flatten())
    return groups


def statistics(recomputer: Recomputer, dump: RolloutDump,
               engine: bool = False) -> tuple[dict[str, Statistic], dict[str, Statistic], bool]:
    """Every option's statistic over the rows ``analyze`` corrects (rows over ``max_policy_lag`` left out, as the
    trainer and the re-application leave them); with ``engine`` every RS option's also on the engine factor
    pi_train@v / mu (``version_log_probs``, as ``Recomputer`` passes it for ``rollout_rs_on="engine"``: the
    correction's second workspace, over the first one's valid tokens; +inf where it has no valid token, which RS
    rejects at any threshold). Returns (option -> ``Statistic``, RS option -> engine ``Statistic`` (empty without
    ``engine``), bypass).

    Raises:
        ConfigError: the dump has no pi_train log-prob column (names the fix).
    """
    column, bypass = _policy_column(recomputer, dump)
    lags_of_rows = recomputer._row_lags()
    parts: dict[tuple[str, str], tuple[list, list, str]] = {}
    inf = float("inf")

    def add(option, unit, values, lags, rs_on="direct"):
        entry = parts.setdefault((rs_on, option), ([], [], unit))
        entry[0].append(values.double())
        entry[1].append(lags)

    # max_policy_lag: the rows the trainer kept (decoupled: at generation, bypass: at use), as analyze re-applies
    kept_rows = recomputer.kept_at_use if bypass else recomputer.kept_at_generation
    for index in _groups(recomputer, bypass):
        b = recomputer.rows.batch(index, policy=column)
        mask = b["mask"] if kept_rows is None else b["mask"] * kept_rows[index][:, None].to(b["mask"].dtype)
        ws = prepare(b["policy"], b["rollout"], mask, _NEEDS)
        valid = ws.valid > 0
        row_lag = lags_of_rows[index]
        token_lag = row_lag.unsqueeze(1).expand_as(valid)[valid]
        rows_ok = ws.row_valid
        for option, (level, stat) in RS_OPTION_PARTS.items():
            if level == "token":
                t = ws.x.abs() if stat == "k1" else ws.token_stat(stat)
                add(option, "tokens", t[valid], token_lag)
            else:
                v = row_values(ws, level, stat)
                add(option, "rows", (v.abs() if stat == "k1" else v)[rows_ok], row_lag[rows_ok])
        add("is_token", "tokens", ws.ratio[valid], token_lag)
        add("is_sequence", "rows", ws.seq_l[rows_ok], row_lag[rows_ok])
        if not engine:
            continue
        rs_ws = prepare(b["rs_version"], b["rollout"], ws.valid, _NEEDS)  # as correction.api for rs_log_probs
        rs_valid = rs_ws.valid > 0
        for option, (level, stat) in RS_OPTION_PARTS.items():
            if level == "token":
                t = rs_ws.x.abs() if stat == "k1" else rs_ws.token_stat(stat)
                add(option, "tokens", torch.where(rs_valid, t.double(), inf)[valid], token_lag, "engine")
            else:
                v = row_values(rs_ws, level, stat).double()
                v = torch.where(rs_ws.row_valid, v.abs() if stat == "k1" else v, inf)
                add(option, "rows", v[rows_ok], row_lag[rows_ok], "engine")
    out: dict[str, dict[str, Statistic]] = {"direct": {}, "engine": {}}
    for (rs_on, option), (values, lags, unit) in parts.items():
        out[rs_on][option] = Statistic(option, unit, torch.cat(values), torch.cat(lags), rs_on)
    return out["direct"], out["engine"], bypass


def engine_unavailable(recomputer: Recomputer, dump: RolloutDump, bypass: bool) -> Optional[str]:
    """Why the dump cannot give thresholds on the engine factor (``rollout_rs_on: engine``), or None when it can:
    bypass rows (engine-factor RS is decoupled only), or analysed rows without ``version_log_probs`` (log pi_train@v:
    records >= 1.1 written with ``policy_lag_split: true``)."""
    if bypass:
        return ("RS on the engine factor needs decoupled mode (pi_old and pi_train@v), and these rows are bypass "
                "(no pi_old): train decoupled with policy_lag_split: true")
    rows = recomputer.rows
    present = "version_log_probs" in rows.columns
    missing = rows.table.column("version_log_probs").null_count if present else rows.n
    if not missing:
        return None
    version = str(dump.metadata.get("schema_version", "?"))
    if missing < rows.n:
        return (f"{missing} of the {rows.n} analysed rows lack column 'version_log_probs' (log pi_train@v): "
                "analyse the steps that have it (--steps)")
    if version == "1.0":
        why = "these are rollout records 1.0, which have no column 'version_log_probs' (log pi_train@v; added in 1.1)"
    else:
        why = (f"the dump (rollout records {version}) has no column 'version_log_probs' (log pi_train@v): the run "
               "was trained without policy_lag_split")
    return f"{why}; re-run the training with policy_lag_split: true (and rollout_dump_dir) to get them"


def pick_threshold(values: torch.Tensor, fraction: float, log_space: bool) -> tuple[float, str]:
    """The threshold that keeps ``fraction`` of ``values`` (module docstring's rule); (threshold, note).

    ``log_space``: values are ``|log ratio|`` (k1) or a log ratio sum (sequence IS); the threshold returned is the
    ratio ``exp(.)`` of the half-way point. Otherwise the k-th smallest value, raised to the smallest positive one when
    it is 0. +inf values (RS rejects them at any threshold: on the engine factor, a token without a finite pi_train@v)
    are never kept: when fewer than k values are finite, the threshold keeps all the finite ones and the note says so.
    """
    v = torch.sort(values.double()).values
    n = int(v.numel())
    k = max(1, min(n, math.ceil(fraction * n - 1e-9)))
    note = ""
    finite = int(torch.isfinite(v).sum())
    if finite < k:
        note = f"{n - finite} of {n} have an infinite statistic, never kept: at most {finite} kept"
        if not finite:
            return (1.0 if log_space else 1e-12), note
        k = finite
    if log_space:
        edge = float(v[k - 1])
        if k < n and math.isfinite(float(v[k])):
            nxt = float(v[k])
            if nxt == edge:
                note = f"ties at the threshold: more than {k} of {n} kept"
            mid = 0.5 * (edge + nxt)
        else:
            mid = edge + max(abs(edge) * 1e-9, 1e-12)
        return math.exp(min(mid, 700.0)), note
    t = float(v[k - 1])
    if k < n and float(v[k]) == t and not note:
        note = f"ties at the threshold: more than {k} of {n} kept"
    if t <= 0:
        positive = v[v > 0]
        t = float(positive[0]) if positive.numel() else 1e-12
        note = "the statistic is 0 at the kept fraction (identical log-probs): the smallest positive value is used"
    return t, note


def _config_for(option: str, threshold: float, trained: RolloutCorrectionConfig,
                bypass: bool, rs_on: str = "direct") -> RolloutCorrectionConfig:
    """The trained config with this option's fields replaced (RS option: IS kept, RS judging ``rs_on``; IS cap: RS
    kept as trained, ``rollout_rs_on`` included, since its YAML sets only the IS fields and so keeps the recipe's
    RS), in the mode of the rows the statistic was read from (bypass rows: RS on the direct ratio, the only one
    bypass has)."""
    base = dict(trained.to_dict(), bypass_mode=bypass, rollout_m2_threshold=None)
    if bypass or base["rollout_rs"] is None:
        base["rollout_rs_on"] = "direct"
    if not bypass:
        base["bypass_loss_type"] = "ppo_clip"
    if option in IS_OPTIONS:
        base.update(rollout_is=option.split("_", 1)[1], rollout_is_threshold=threshold,
                    rollout_is_batch_normalize=False)
    else:
        base.update(rollout_rs=option, rollout_rs_threshold=threshold, rollout_rs_on=rs_on)
    if base["rollout_is"] is None:
        base["rollout_is_threshold"] = None
        base["rollout_is_batch_normalize"] = False
    if base["rollout_rs"] is None:
        base["rollout_rs_threshold"] = None
    with warnings.catch_warnings():  # a cap U < 1 is what the user asked for when the kept fraction is small
        warnings.simplefilter("ignore", UserWarning)
        return RolloutCorrectionConfig(**base)


@dataclass
class Suggestions:
    """What ``suggest`` found.

    Attributes:
        direct: one ``Suggestion`` per chosen option, on the correction's own ratio (RS and IS), in option order.
        engine: one per chosen RS option on the engine factor (``rs_on == "engine"``), or empty.
        engine_left_out: why ``engine`` is empty although RS options were chosen (``engine_unavailable``), or None.
    """

    direct: list[Suggestion]
    engine: list[Suggestion]
    engine_left_out: Optional[str] = None

    @property
    def all(self) -> list[Suggestion]:
        return [*self.direct, *self.engine]


def suggest(dump: RolloutDump, *, keep: Optional[float] = None, quantile: Optional[float] = None,
            options: Optional[Sequence[str]] = None, steps: Optional[tuple[int, int]] = None,
            length_buckets: Optional[Sequence[int]] = None, engine: Optional[bool] = None) -> Suggestions:
    """A threshold per option (``--keep`` or ``--quantile``) and its re-application over the dump; for the RS options
    also one on the engine factor (module docstring).

    Args:
        dump: an open dump. keep: the kept fraction in (0, 1]. quantile: the lag-0 quantile in (0, 1]; exactly one
            of the two. options: RS options and/or ``is_token`` / ``is_sequence`` (default all). steps: logged steps
            (inclusive). length_buckets: slice edges (default the trainer's). engine: None (default): the engine-factor
            suggestions when the dump can give them, else left out with the reason; True: required (an error when
            the dump cannot give them); False: none.

    Raises:
        ConfigError: neither or both of keep / quantile, a value outside (0, 1], an unknown option, a dump without
            the log-prob columns, no use at lag 0 for ``quantile``, a dump ``analyze`` refuses, or ``engine=True``
            with no RS option chosen or on a dump without ``version_log_probs`` / with bypass rows (names the fix).
    """
    if (keep is None) == (quantile is None):
        raise ConfigError("--suggest needs exactly one of --keep F (the kept fraction of tokens or rows, e.g. 0.99) "
                          "or --quantile Q (the lag-0 quantile of each statistic, e.g. 0.99).")
    target = keep if keep is not None else quantile
    flag = "--keep" if keep is not None else "--quantile"
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < float(target) <= 1.0:
        raise ConfigError(f"{flag} {target!r}: expected a fraction in (0, 1], e.g. 0.99.")
    known = (*RS_OPTION_PARTS, *IS_OPTIONS)
    chosen = tuple(options) if options else known
    unknown = [o for o in chosen if o not in known]
    if unknown:
        raise ConfigError(f"--suggest-options: unknown option {unknown[0]!r}; options: {', '.join(known)}.")
    rs_chosen = [o for o in chosen if o not in IS_OPTIONS]
    if engine and not rs_chosen:
        raise ConfigError("--suggest-engine suggests RS thresholds on the engine factor, and --suggest-options "
                          "chose only IS caps (IS weights the whole ratio): add an RS option, or drop "
                          "--suggest-engine.")
    recomputer = Recomputer(dump, analysable_windows(dump, steps))
    _, bypass = _policy_column(recomputer, dump)
    left_out = engine_unavailable(recomputer, dump, bypass) if rs_chosen and engine is not False else None
    if engine and left_out:
        raise ConfigError(f"--suggest-engine: no thresholds on the engine factor pi_train@v / mu from {dump.path}: "
                          f"{left_out}; or drop --suggest-engine (the whole-ratio suggestions need no more).")
    with_engine = bool(rs_chosen) and engine is not False and left_out is None
    stats, engine_stats, bypass = statistics(recomputer, dump, engine=with_engine)
    trained = dump.correction_config()
    edges = tuple(length_buckets) if length_buckets is not None else dump.length_buckets

    def one(st: Statistic) -> Suggestion:
        values = st.values if keep is not None else st.values[st.lags == 0]
        if not values.numel():
            if keep is not None:
                raise ConfigError(f"{dump.path}: no valid {st.unit} in the analysed steps; check --steps.")
            raise ConfigError(f"--quantile needs uses at policy lag 0 (the engine mismatch alone), and {dump.path} "
                              "has none in the analysed steps: use --keep, or widen --steps.")
        threshold, note = pick_threshold(values, float(target), st.log_space)
        config = _config_for(st.option, threshold, trained, bypass, st.rs_on)
        analysis = recomputer.analyse(NamedConfig(f"suggest {_name(st.option, st.rs_on)}", config), edges)
        return Suggestion(st.option, st.unit, float(target), int(values.numel()), threshold, config, analysis, note,
                          st, st.rs_on)

    direct = [one(stats[option]) for option in chosen]
    on_engine = [one(engine_stats[option]) for option in rs_chosen] if with_engine else []
    return Suggestions(direct, on_engine, left_out)


# ---------------------------------------------------------------------------------------------- outputs
def yaml_text(s: Suggestion, keep: bool) -> str:
    """A YAML mapping for one suggestion (only correction fields: it pastes into a recipe config), with a comment
    saying what it keeps; also valid for ``analyze --config`` (labelled by its file name)."""
    kept = s.kept()
    what = ("untruncated weights" if s.option in IS_OPTIONS else f"kept {s.unit}")
    how = (f"--keep {s.target:g}" if keep else f"--quantile {s.target:g} at lag 0")
    lines = [f"# {s.option}: {how}; {what} on the analysed steps: "
             f"{'n/a' if kept is None else f'{100 * kept:.2f}%'}" + (f" ({s.note})" if s.note else "")]
    if s.rs_on == "engine":
        lines[0] = lines[0].replace(f"# {s.option}: ", f"# {s.option} on the engine factor pi_train@v / mu: ", 1)
        lines.append("# (RS only; IS still weights pi_old / mu. Training needs policy_lag_split: true, decoupled.)")
    for key, value in s.yaml.items():
        lines.append(f"{key}: {value}" if isinstance(value, str) else f"{key}: {value!r}")
    return "\n".join(lines) + "\n"


def report(result: Suggestions) -> dict[str, Any]:
    """``suggest.json``: per option the threshold, its config, the kept fraction, and the summaries by lag and
    length (``suggestions``: the whole ratio; ``engine_suggestions``: RS on the engine factor, each with
    ``"rs_on": "engine"`` and its ``name``; ``engine_left_out``: why there are none, or null)."""
    def entry(s: Suggestion) -> dict[str, Any]:
        return {
            "option": s.option, "unit": s.unit, "target": s.target, "population": s.population,
            "threshold": s.threshold, "note": s.note, "config": s.config.to_dict(), "kept": s.kept(),
            "total": summary_row(s.analysis.total),
            "by_lag": {str(lag): summary_row(p) for lag, p in sorted(s.analysis.by_lag.items())},
            "by_length": length_slices(s.analysis),
        }

    return {"suggestions": [entry(s) for s in result.direct],
            "engine_suggestions": [{"name": s.name, "rs_on": s.rs_on, **entry(s)} for s in result.engine],
            "engine_left_out": result.engine_left_out}


def _curve(st: Statistic) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold axis, kept %) of one statistic: the kept fraction at each finite value (infinite ones are never
    kept, so the curve of the engine factor stops below 100% when some token has no finite pi_train@v)."""
    v = torch.sort(st.values.double()).values
    frac = torch.arange(1, v.numel() + 1, dtype=torch.float64) / max(v.numel(), 1)
    finite = torch.isfinite(v)
    v, frac = v[finite], frac[finite]
    # the threshold is a ratio for k1 (band [1/u, u]) and the sequence IS cap: exp of |log ratio| or of the row sum
    return (torch.exp(v.clamp(max=700.0)) if st.log_space else v), 100.0 * frac


def figure(suggestions: Sequence[Suggestion], out_dir: Path, identity: dict[str, Any],
           engine: Sequence[Suggestion] = ()) -> Path:
    """``suggest_kept_vs_threshold.png``: per option, the fraction of tokens / rows kept (IS: untruncated) against
    the threshold, over every analysed use, with the suggested threshold marked; an RS option with a suggestion in
    ``engine`` also shows the curve and threshold on the engine factor (orange) next to the whole ratio's (blue)."""
    from .plotting import _new_figure, _save

    on_engine = {s.option: s for s in engine}
    n = len(suggestions)
    cols = 4
    rows = max(1, math.ceil(n / cols))
    fig, axes = _new_figure(rows, cols, "Kept fraction against threshold, per option (this run's records)", identity,
                            size=(16.0, 3.2 * rows + 1.5))
    for ax, s in zip(axes.flat, suggestions):
        st = s.statistic
        if st.log_space:
            xlabel = "u (band [1/u, u] on the ratio)" if s.option.endswith("_k1") else "cap U on the sequence ratio"
        else:
            xlabel = "cap U on the token ratio" if s.option == "is_token" else "threshold (keep stat <= it)"
        x, kept_pct = _curve(st)
        e = on_engine.get(s.option)
        ax.step(x.tolist(), kept_pct.tolist(), where="post", color="C0", label="whole ratio" if e else None)
        ax.axvline(s.threshold, color="C3", linestyle="--", linewidth=1.0)
        kept = s.kept()
        if kept is not None:
            ax.axhline(100.0 * kept, color="grey", linestyle=":", linewidth=0.8)
        title = f"{s.option}: {s.threshold:.3g}"
        if e is not None:
            ex, e_pct = _curve(e.statistic)
            ax.step(ex.tolist(), e_pct.tolist(), where="post", color="C1", label="engine factor")
            ax.axvline(e.threshold, color="C1", linestyle="--", linewidth=1.0)
            ax.legend(fontsize=7, loc="lower right")
            title += f" (engine {e.threshold:.3g})"
            x = torch.cat([x, ex])
        positive = x[x > 0]
        if positive.numel() and float(positive.max()) / float(positive.min()) > 100:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(("untruncated" if s.option in IS_OPTIONS else "kept") + f" {st.unit} (%)", fontsize=8)
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return _save(fig, out_dir / "suggest_kept_vs_threshold.png")
