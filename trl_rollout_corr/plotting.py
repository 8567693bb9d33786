"""PNG figures of ``trl-rollout-corr analyze`` and ``probe``, with matplotlib (optional).

Every figure has a title, axis labels with units, zero/reference lines, and the run's identity (model, engine,
dtypes, config) in its footer, so a figure copied out of context still says what it shows. Figures are drawn on
``matplotlib.figure.Figure`` objects (no pyplot, no global backend change) and saved at 120 dpi.

matplotlib is not a dependency of the core package: ``require_matplotlib`` raises ``PlottingUnavailable`` naming the
extra to install (``trl-rollout-corr[cpu]``) or ``--no-plots``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .analyze import Analysis

BAND = (0.9, 1.1)


class PlottingUnavailable(ImportError):
    """matplotlib is not installed; the message names the extra to install."""


def require_matplotlib():
    """The ``matplotlib.figure.Figure`` class.

    Raises:
        PlottingUnavailable: matplotlib is not importable (install ``trl-rollout-corr[cpu]`` or ``matplotlib``, or
            pass ``--no-plots``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlottingUnavailable(
            "The plots need matplotlib, which is not installed here: pip install 'trl-rollout-corr[cpu]' (or pip "
            "install 'matplotlib>=3.8'), or pass --no-plots to skip them."
        ) from e
    return Figure


def identity_text(identity: Mapping[str, Any], width: int = 150) -> str:
    """``key: value | key: value ...`` wrapped at ``width`` characters (the figure footer)."""
    parts = [f"{k}: {v}" for k, v in identity.items() if v not in (None, "")]
    lines, line = [], ""
    for part in parts:
        candidate = part if not line else f"{line} | {part}"
        if len(candidate) > width and line:
            lines.append(line)
            line = part
        else:
            line = candidate
    lines.append(line)
    return "\n".join(lines)


def _new_figure(rows: int, cols: int, title: str, identity: Mapping[str, Any], size=(12.0, 7.5), legend=False):
    Figure = require_matplotlib()
    fig = Figure(figsize=size)
    axes = fig.subplots(rows, cols, squeeze=False)
    fig.suptitle(title, fontsize=13)
    footer = identity_text(identity)
    fig.text(0.01, 0.005, footer, fontsize=7, va="bottom", ha="left", family="monospace", color="#333333")
    # room for the x labels (about 0.8 inch, rotated tick labels included) plus the footer lines (about 0.13 inch each)
    bottom = (0.85 + 0.13 * (footer.count("\n") + 1)) / size[1]
    top = 1.0 - (1.0 if legend else 0.65) / size[1]  # the title, and a figure legend under it
    fig.subplots_adjust(left=0.08, right=0.98, top=top, bottom=bottom, hspace=0.5, wspace=0.28)
    return fig, axes


MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", ":", "-.")


def _style(k: int) -> dict:
    """Marker and line style of series ``k`` (overlapping series stay visible)."""
    return {"marker": MARKERS[k % len(MARKERS)], "linestyle": LINESTYLES[k % len(LINESTYLES)],
            "markersize": 7 - (k % 3), "markerfacecolor": "none" if k % 2 else None}


def _figure_legend(fig, ax, height: float) -> None:
    """One legend for the whole figure, under the title (``_new_figure(..., legend=True)`` leaves the room)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper center", ncol=min(len(labels), 4),
               bbox_to_anchor=(0.5, 1.0 - 0.5 / height))


def _pct(value: Optional[float]) -> float:
    return math.nan if value is None else 100.0 * value


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path


# ---------------------------------------------------------------------------------------------- analyze
def analyze_figures(analyses: Sequence["Analysis"], out_dir: Path, identity: Mapping[str, Any]) -> list[Path]:
    """``analyze_per_step.png`` (kept tokens, kept rows, IS ESS and k3 KL per logged step, one line per config) and
    ``analyze_slices.png`` (kept tokens and k3 KL per response-length bucket, and per policy lag)."""
    return [_analyze_per_step_figure(analyses, out_dir, identity), _analyze_slices_figure(analyses, out_dir, identity)]


def _analyze_per_step_figure(analyses: Sequence["Analysis"], out_dir: Path, identity: Mapping[str, Any]) -> Path:
    """``analyze_per_step.png``: kept tokens, kept rows, IS ESS and k3 KL per logged step, one line per config."""
    from .analyze import summary_row

    fig, axes = _new_figure(2, 2, "What-if: the rollout correction of each config on the stored steps", identity,
                            legend=True)
    panels = (("kept_tokens", "kept tokens (% of valid)", 100.0), ("kept_rows", "kept rows (% of valid)", 100.0),
              ("ess", "IS effective sample size (fraction, tokens)", 1.0),
              ("kept_k3", "k3 KL of the kept tokens (nats / token)", 1.0))
    from matplotlib.ticker import MaxNLocator

    for ax, (key, label, scale) in zip(axes.flat, panels):
        for k, a in enumerate(analyses):
            steps = [w.logged_step for w in a.windows]
            values = [summary_row(a.per_window[s])[key] for s in steps]
            if all(v is None for v in values):
                continue
            ax.plot(steps, [math.nan if v is None else v * scale for v in values], label=a.named.label, **_style(k))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        every_step = [w.logged_step for a in analyses for w in a.windows]
        ax.set_xlim(min(every_step) - 0.5, max(every_step) + 0.5)
        ax.set_xlabel("logged optimizer step")
        ax.set_ylabel(label)
        ax.axhline(0.0, color="black", linewidth=0.8)
        if scale == 100.0 or key == "ess":
            ax.axhline(scale, color="grey", linewidth=0.8, linestyle="--")
        ax.grid(alpha=0.3)
    _figure_legend(fig, axes[0, 0], height=7.5)
    return _save(fig, out_dir / "analyze_per_step.png")


def _analyze_slices_figure(analyses: Sequence["Analysis"], out_dir: Path, identity: Mapping[str, Any]) -> Path:
    """``analyze_slices.png``: kept tokens and k3 KL per response-length bucket, and kept tokens per policy lag."""
    from .analyze import length_slices, summary_row

    lags = sorted({lag for a in analyses for lag in a.by_lag})
    fig, axes = _new_figure(1, 3, "What-if by slice: response length and policy lag", identity, size=(14.0, 6.5),
                            legend=True)
    n = len(analyses)
    width = 0.8 / max(n, 1)
    buckets = [row["bucket"] for row in length_slices(analyses[0])]
    for k, a in enumerate(analyses):
        rows = length_slices(a)
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(rows))]
        axes[0, 0].bar(xs, [_pct(r["kept_tokens"]) for r in rows], width=width, label=a.named.label)
        axes[0, 1].bar(xs, [math.nan if r["kept_k3"] is None else r["kept_k3"] for r in rows], width=width,
                       label=a.named.label)
        lag_x = [i + (k - (n - 1) / 2) * width for i in range(len(lags))]
        axes[0, 2].bar(lag_x, [_pct(summary_row(a.by_lag[lag])["kept_tokens"]) if lag in a.by_lag else math.nan
                               for lag in lags], width=width, label=a.named.label)
    for ax, label in ((axes[0, 0], "kept tokens (% of valid)"),
                      (axes[0, 1], "k3 KL of the kept tokens (nats / token)")):
        ax.set_xticks(range(len(buckets)))
        ax.set_xticklabels(buckets)
        ax.set_xlabel("response length (valid tokens per row)")
        ax.set_ylabel(label)
    axes[0, 2].set_xticks(range(len(lags)))
    axes[0, 2].set_xticklabels([str(lag) for lag in lags])
    axes[0, 2].set_xlabel("policy lag (optimizer steps, use - generation)")
    axes[0, 2].set_ylabel("kept tokens (% of valid)")
    for ax in axes.flat:
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3, axis="y")
    _figure_legend(fig, axes[0, 0], height=6.5)
    return _save(fig, out_dir / "analyze_slices.png")


# ---------------------------------------------------------------------------------------------- probe
def probe_figures(report: Mapping[str, Any], log_ratios: Mapping[str, Sequence[float]],
                  self_consistency: Optional[Sequence[float]], out_dir: Path,
                  identity: Mapping[str, Any]) -> list[Path]:
    """``probe_log_ratio.png`` (histogram of log pi_train - log mu, by variant), ``probe_by_position.png`` (|log
    ratio| quantiles and the out-of-band fraction per completion position) and, when measured,
    ``probe_self_consistency.png`` (the trainer's batch-1 vs batch-B log-prob difference)."""
    paths = [_probe_log_ratio_figure(log_ratios, out_dir, identity),
             _probe_by_position_figure(report, out_dir, identity)]
    if self_consistency is not None and len(self_consistency):
        paths.append(_probe_self_consistency_figure(report, self_consistency, out_dir, identity))
    return paths


def _probe_log_ratio_figure(log_ratios: Mapping[str, Sequence[float]], out_dir: Path,
                            identity: Mapping[str, Any]) -> Path:
    """``probe_log_ratio.png``: the histogram of log pi_train - log mu, one line per variant."""
    import numpy as np

    lo, hi = math.log(BAND[0]), math.log(BAND[1])
    fig, axes = _new_figure(1, 1, "Engine vs trainer: log pi_train - log mu per sampled token", identity,
                            size=(11.0, 6.5))
    ax = axes[0, 0]
    every = np.concatenate([np.asarray(v, dtype=np.float64) for v in log_ratios.values() if len(v)] or [np.zeros(1)])
    span = max(float(np.max(np.abs(every))), abs(lo) * 1.2, 1e-6)
    bins = np.linspace(-span, span, 121)
    for name, values in log_ratios.items():
        ax.hist(np.asarray(values, dtype=np.float64), bins=bins, histtype="step", linewidth=1.4,
                label=f"{name} ({len(values)} tokens)")
    ax.set_yscale("log")
    ax.axvline(0.0, color="black", linewidth=0.9)
    for x, text in ((lo, f"ratio {BAND[0]}"), (hi, f"ratio {BAND[1]}")):
        ax.axvline(x, color="red", linewidth=0.8, linestyle="--")
        ax.text(x, ax.get_ylim()[1], text, color="red", fontsize=8, ha="center", va="bottom")
    ax.set_xlabel("log ratio log pi_train(token) - log mu(token) (nats)")
    ax.set_ylabel("tokens (log scale)")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    return _save(fig, out_dir / "probe_log_ratio.png")


def _probe_by_position_figure(report: Mapping[str, Any], out_dir: Path, identity: Mapping[str, Any]) -> Path:
    """``probe_by_position.png``: |log ratio| quantiles and the out-of-band fraction per completion position."""
    rows = report.get("by_position", [])
    fig, axes = _new_figure(1, 2, "Mismatch by completion position", identity, size=(12.0, 5.5))
    labels = [r["bucket"] for r in rows]
    xs = list(range(len(rows)))
    for key, label in (("p50_abs", "p50"), ("p99_abs", "p99"), ("max_abs", "max")):
        axes[0, 0].plot(xs, [max(r[key], 1e-12) for r in rows], marker="o", label=f"|log ratio| {label}")
    axes[0, 0].set_yscale("log")
    axes[0, 0].set_ylabel("|log pi_train - log mu| (nats, log scale)")
    axes[0, 1].bar(xs, [100.0 * r["out_of_band"] for r in rows], color="tab:red")
    axes[0, 1].axhline(0.0, color="black", linewidth=0.8)
    axes[0, 1].set_ylabel(f"tokens with ratio outside [{BAND[0]}, {BAND[1]}] (%)")
    for ax in axes.flat:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30)
        ax.set_xlabel("completion position (tokens from the prompt)")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    return _save(fig, out_dir / "probe_by_position.png")


def _probe_self_consistency_figure(report: Mapping[str, Any], self_consistency: Sequence[float], out_dir: Path,
                                   identity: Mapping[str, Any]) -> Path:
    """``probe_self_consistency.png``: the trainer's batch-1 vs batch-B log-prob difference."""
    import numpy as np

    sc = report.get("self_consistency", {})
    fig, axes = _new_figure(1, 1, f"Trainer self-consistency: the same tokens at batch 1 vs batch "
                            f"{sc.get('batch_size', '?')}", identity, size=(11.0, 6.0))
    ax = axes[0, 0]
    values = np.asarray(self_consistency, dtype=np.float64)
    span = max(float(np.max(np.abs(values))), 1e-7)
    ax.hist(values, bins=np.linspace(-span, span, 121), color="tab:purple")
    ax.set_yscale("log")
    ax.axvline(0.0, color="black", linewidth=0.9)
    ax.set_xlabel(f"log pi_train at batch 1 - at batch {sc.get('batch_size', '?')} (nats)")
    ax.set_ylabel("tokens (log scale)")
    ax.grid(alpha=0.3)
    return _save(fig, out_dir / "probe_self_consistency.png")
