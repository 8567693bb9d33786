"""The report of ``async_wallclock.py`` (issue 47): held-out accuracy against training seconds, synchronous against
asynchronous GRPO. Pure statistics over committed cells (``cell.json``: see ``async_wallclock``'s docstring for what
each number means), the RESULTS.md section between its markers, and the figure ``benchmarks/async_wallclock.png``.

* PRIMARY endpoint, paired by seed against ``sync_t2`` (the 2-core user's real alternative) and against
  ``sync_t1``: the ratio of training seconds to reach the last step N, a 95 % Student-t interval on the log ratio
  (n - 1 df), shown back-transformed (geometric mean ratio [lo, hi]);
* DESCRIPTIVE, beside the A/A null ``sync_t2`` vs ``sync_t1`` (the same algorithm, only the thread count differs:
  its accuracy difference is noise): the final 512-item accuracy (per setting: mean [95 % t-interval]; paired:
  the difference in points), the accuracy at equal training seconds (each setting's 128-item curve interpolated at
  the same seed's ``sync_t2`` final training seconds, held at its last check when it finished earlier), the curve
  (the figure) and time-to-reach the start + ``reach_points`` points (a 5-point step on 128 items is about 1.4
  binomial standard errors: descriptive only). Stated before any cell ran: with 3 seeds the 95 % half-width of a
  paired accuracy difference is about 28 points (seed sd about 8.5 points, t(0.975, 2) = 4.30; pairing shares only
  the prompt order, so the seeds' noise barely cancels), so no accuracy claim is expected;
* per setting also: seeds, the median step (median over seeds of each cell's median ``step_s``, step 1 left out)
  and the training seconds to the last step (mean over seeds).

Until a cell is committed the section says "not run yet" and lists the missing cells: no number is shown that was
not measured.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import async_wallclock_checks as checks  # noqa: E402  (benchmarks/, next to this file)
import policy_lag_stats as stats  # noqa: E402
from async_cells import SETTINGS  # noqa: E402
from results_md import RESULTS as RESULTS_MD  # noqa: E402
from results_md import replace_section  # noqa: E402

BEGIN = "<!-- BEGIN async_wallclock.py output -->"
END = "<!-- END async_wallclock.py output -->"
FIGURE = ROOT / "benchmarks" / "async_wallclock.png"
REFERENCES = ("sync_t2", "sync_t1")  # the 2-core user's real alternative, and the 1-thread synchronous run
NULL = ("sync_t2", "sync_t1")  # the A/A null: the same algorithm, only the thread count differs
EQUAL_TIME_AT = "sync_t2"  # accuracy at equal training seconds: each curve at this setting's final time
ENGINES = {"server": "TRL's vLLM server, float32; the asynchronous settings are the real pipeline, "
                     "`rollout_async_depth` d",
           "transformers": "a smoke path: TRL's `generate` in the synchronous trainer, the transformers engine "
                           "process for the asynchronous settings: not the same generator"}
WIDTH = 120  # RESULTS.md's line cap


def load_cells(results: Path) -> dict[str, dict]:
    """{cell name: its ``cell.json``} for every committed cell under ``results`` (empty when none)."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(results.glob("*/cell.json"))}


def curve(cell: dict) -> list[tuple[float, float]]:
    """A cell's (training seconds, accuracy fraction) points on the 128-item checks, in step order."""
    return [(c["train_s"], c["correct"] / c["total"]) for c in sorted(cell["checkpoints"], key=lambda c: c["step"])]


def time_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """The training seconds at which the curve ``points`` ((seconds, accuracy), in time order) first reaches
    ``target``: linear between the last point below it and the first at or above it (the first point's time when
    it starts there); None when never reached.

    Raises:
        ValueError: no points, or times not non-decreasing."""
    if not points or any(b[0] < a[0] for a, b in zip(points, points[1:])):
        raise ValueError(f"time_to_reach needs points in time order, got {points}")
    for i, (t, acc) in enumerate(points):
        if acc >= target:
            if i == 0:
                return t
            t0, a0 = points[i - 1]
            return t0 + (t - t0) * (target - a0) / (acc - a0)
    return None


def median_step(cell: dict) -> float:
    """The cell's median ``step_s`` over steps 2..n (all steps when there is one)."""
    steps = [r["step_s"] for r in cell["steps"]]
    return statistics.median(steps[1:] or steps)


def train_seconds(cell: dict) -> float:
    """Training seconds to the cell's last step (``clock_s`` of its last step)."""
    return cell["steps"][-1]["clock_s"]


def final_accuracy(cell: dict) -> float:
    return cell["final"]["correct"] / cell["final"]["total"]


def reach_seconds(cell: dict, points: float) -> float | None:
    """``time_to_reach`` of the cell's own start (its step-0 check) + ``points`` percentage points."""
    pts = curve(cell)
    return time_to_reach(pts, pts[0][1] + points / 100)


def by_setting(cells: dict[str, dict]) -> dict[str, dict[int, dict]]:
    """{setting: {seed: cell}} in ``SETTINGS`` order (settings without cells left out)."""
    out: dict[str, dict[int, dict]] = {}
    for setting in SETTINGS:
        got = {c["seed"]: c for c in cells.values() if c["setting"] == setting}
        if got:
            out[setting] = dict(sorted(got.items()))
    return out


def reach_text(times: list[float | None]) -> str:
    """``3 of 3 seeds, median 410 s``; the median counts a seed that never reached the target as infinitely late
    (``not reached by the median seed`` then)."""
    reached = [t for t in times if t is not None]
    med = statistics.median([math.inf if t is None else t for t in times])
    return f"{len(reached)} of {len(times)} seeds, " + (f"median {med:.0f} s" if math.isfinite(med)
                                                        else "not reached by the median seed")


def setting_rows(groups: dict[str, dict[int, dict]], reach_points: float) -> list[str]:
    """The per-setting table (Markdown lines, header included)."""
    lines = ["| setting | seeds | median step s | training s | final acc. % [95 % CI] | % at "
             f"{EQUAL_TIME_AT}'s s | reaches start + {reach_points:g} pts |",
             "|---|---|---|---|---|---|---|"]
    for setting, seeds in groups.items():
        finals = stats.t_interval([final_accuracy(c) for c in seeds.values()])
        equal = equal_time_accuracy(groups, setting)
        equal_text = f"{100 * statistics.fmean(equal.values()):.1f} (n = {len(equal)})" if equal else "-"
        lines.append(f"| {setting} | {', '.join(map(str, seeds))} | "
                     f"{statistics.median(median_step(c) for c in seeds.values()):.2f} | "
                     f"{statistics.fmean(train_seconds(c) for c in seeds.values()):.0f} | "
                     f"{_interval(finals, signed=False)} | {equal_text} | "
                     f"{reach_text([reach_seconds(c, reach_points) for c in seeds.values()])} |")
    return lines


def log_ratio_interval(ratios: list[float], level: float = 0.95) -> stats.Interval:
    """The geometric mean of positive ratios with its ``level`` interval: Student-t on the log ratios (n - 1 df),
    back-transformed (``exp``); ``p`` is the t-test of log ratio 0 (ratio 1).

    Raises:
        ValueError: a ratio that is not positive and finite."""
    if not ratios or not all(math.isfinite(r) and r > 0 for r in ratios):
        raise ValueError(f"log_ratio_interval needs positive finite ratios, got {ratios}")
    iv = stats.t_interval([math.log(r) for r in ratios], level)
    return stats.Interval(math.exp(iv.mean), math.exp(iv.lo), math.exp(iv.hi), iv.n, iv.df, iv.p)


def accuracy_at(points: list[tuple[float, float]], t: float) -> float:
    """The curve ``points`` ((training seconds, accuracy), time order) at ``t`` seconds: linear between checks; a
    run that finished before ``t`` is held at its last check (training stopped at step N).

    Raises:
        ValueError: no points, or ``t`` before the first point."""
    if not points or t < points[0][0]:
        raise ValueError(f"accuracy_at({t}) needs points starting at or before it, got {points}")
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def equal_time_accuracy(groups: dict[str, dict[int, dict]], setting: str, reference: str = EQUAL_TIME_AT):
    """Per seed that has both: ``setting``'s 128-item curve at ``reference``'s final training seconds (same seed);
    {seed: accuracy fraction}. Descriptive."""
    ref = groups.get(reference, {})
    return {s: accuracy_at(curve(c), train_seconds(ref[s])) for s, c in groups.get(setting, {}).items() if s in ref}


def paired(groups: dict[str, dict[int, dict]], setting: str, reference: str):
    """Paired by seed, ``setting`` against ``reference``: (seeds, ``log_ratio_interval`` of the training-seconds
    ratios to step N (the primary endpoint), ``t_interval`` of the final accuracy differences (descriptive)); None
    when no seed has both."""
    seeds = sorted(set(groups.get(setting, {})) & set(groups.get(reference, {})))
    if not seeds:
        return None
    a, b = groups[setting], groups[reference]
    return (seeds, log_ratio_interval([train_seconds(a[s]) / train_seconds(b[s]) for s in seeds]),
            stats.t_interval([final_accuracy(a[s]) - final_accuracy(b[s]) for s in seeds]))


def comparisons() -> list[tuple[str, str]]:
    """(setting, reference) pairs in table order: the A/A null (``NULL``) first, then every other setting against
    each of ``REFERENCES``."""
    return [NULL, *((s, ref) for ref in REFERENCES for s in SETTINGS if s not in (ref, *NULL))]


def paired_rows(groups: dict[str, dict[int, dict]]) -> list[str]:
    lines = ["| comparison | seeds | training s to step N, ratio [95 % CI] (primary) | final acc., points [95 % CI] "
             "(descriptive) |", "|---|---|---|---|"]
    for setting, ref in comparisons():
        got = paired(groups, setting, ref)
        if got:
            seeds, ratio, diff = got
            label = f"{setting} vs {ref}" + (" (A/A null: threads only)" if (setting, ref) == NULL else "")
            lines.append(f"| {label} | {', '.join(map(str, seeds))} | "
                         f"{_interval(ratio, scale=1.0, digits=3, signed=False)} | {stats.fmt_interval(diff)} |")
    return lines if len(lines) > 2 else [f"No seed has both a setting and `{REFERENCES[0]}` or `{REFERENCES[1]}` "
                                         "yet: no paired comparison."]


def _interval(iv: stats.Interval, scale: float = 100.0, digits: int = 1, signed: bool = True) -> str:
    text = stats.fmt_interval(iv, scale, digits)
    return text if signed else text.replace("+", "")


def _schedule_text(design: dict) -> str:
    """``2 steps to step 16, then every 8`` (``8`` without a dense part)."""
    until = design.get("check_dense_until", 0)
    return (f"{design['check_dense_every']} steps to step {until}, then every {design['check_every']}" if until
            else f"{design['check_every']}")


def _para(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def section(cells: dict[str, dict], expected: list[str], design: dict, reach_points: float,
            notes: dict | None = None, figure: Path = FIGURE) -> str:
    """The RESULTS.md section, markers included: the regime, then the tables, or "not run yet" and the missing
    cells (``expected`` less the committed ones); ``figure``: where ``write`` puts the figure (named in the text).
    ``cells``: the cells that passed ``async_wallclock_checks``;
    ``notes`` (``write``): ``committed`` (names of every committed cell), ``left_out`` and ``flagged`` (lines
    ``name: reason``), ``revisions`` ({code revision: cells})."""
    notes = notes or {}
    head = [BEGIN, "", "### Accuracy against training wall clock, synchronous and asynchronous GRPO "
            "(`benchmarks/async_wallclock.py`)", "",
            _para(f"Regime: the main job's chain_sum from the base model `{design['model']}`, {design['steps']} steps "
                  f"x {design['prompts']} prompts x 4 completions, lr {design['lr']:g}, preset `{design['preset']}` "
                  f"in every setting, engine `{design['engine']}` ({ENGINES.get(design['engine'], '?')}). "
                  "Settings: `sync_t1` / "
                  "`sync_t2` synchronous at 1 / 2 torch threads (trainer and server), `async_d1` / `async_d2` at "
                  "depth 1 / 2 (trainer 1 thread, server 1 OpenMP thread), "
                  "`async_d1_t2` depth 1 with the trainer at 2 threads. "
                  + _spin_text(checks.recorded_design(design)["server_spin_s"]) + " Training seconds: wall clock from "
                  "`train()`'s entry, weight copies for "
                  "the evaluation excluded; greedy evaluation after training on those copies ("
                  f"{design['check_size']} held-out items every {_schedule_text(design)} steps, "
                  f"{design['eval_size']} at the end). Primary endpoint: the training seconds to the last step, "
                  "paired by seed against `sync_t2` (the 2-core user's alternative) and `sync_t1`: geometric mean "
                  "ratio [95 % Student-t interval on the log ratio, n - 1 df]. Accuracy (final, at `sync_t2`'s "
                  "training seconds, the curve) is descriptive, beside the A/A null `sync_t2` vs `sync_t1` "
                  "(same algorithm, threads only): with 3 seeds an accuracy difference's 95 % half-width is "
                  "about 28 points, so no accuracy claim is expected."), ""]
    missing = [c for c in expected if c not in cells and c not in notes.get("committed", ())]
    checked = [_para(f"{title} ({len(lines)}): {'; '.join(lines)}.") for title, lines in (
        ("Left out", notes.get("left_out", [])), ("Ran beside other load (kept, flagged)", notes.get("flagged", [])))
        if lines]
    if notes.get("revisions") and cells:
        checked.append(_para("Code revisions: " + "; ".join(f"`{rev}` ({', '.join(names)})"
                                                           for rev, names in notes["revisions"].items()) + "."))
    checked = [line for text in checked for line in ("", text)]
    if not cells:
        body = [_para(f"Not run yet: no cell is committed under `benchmarks/results/async_wallclock`. Missing, in run "
                      f"order ({len(missing)}): {', '.join(missing)}.")]
        return "\n".join([*head, *body, *checked, "", END])
    groups = by_setting(cells)
    body = [*setting_rows(groups, reach_points), "", *paired_rows(groups), "",
            _para(f"Figure: `{_shown(figure)}` (the {design['check_size']}-item curve against training "
                  "seconds, mean over seeds per setting, each seed faint).")]
    if missing:
        body += ["", _para(f"Still to run ({len(missing)}): {', '.join(missing)}.")]
    return "\n".join([*head, *body, *checked, "", END])


def plot(cells: dict[str, dict], path: Path) -> None:
    """Accuracy (128-item checks, %) against training seconds: per setting the mean over seeds at each checked step
    (mean seconds, mean accuracy) as a line, every seed's curve faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (setting, seeds) in enumerate(by_setting(cells).items()):
        color = f"C{i}"
        curves = [curve(c) for c in seeds.values()]
        for pts in curves:
            ax.plot([t for t, _ in pts], [100 * a for _, a in pts], "o-", color=color, alpha=0.2, lw=1, ms=3)
        n = min(len(p) for p in curves)
        mean = [(statistics.fmean(p[j][0] for p in curves), statistics.fmean(p[j][1] for p in curves))
                for j in range(n)]
        ax.plot([t for t, _ in mean], [100 * a for _, a in mean], "o-", color=color, lw=2,
                label=f"{setting} (n = {len(curves)})")
    ax.set_xlabel("training seconds (evaluation excluded)")
    n_items = sorted({c["total"] for cell in cells.values() for c in cell["checkpoints"]})
    ax.set_ylabel(f"held-out greedy accuracy, % ({', '.join(map(str, n_items))} items)")
    ax.set_title("Synchronous vs asynchronous GRPO: accuracy against wall clock")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shown(path: Path) -> str:
    """``path`` relative to the repository root where it is inside it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _spin_text(spin_s: float) -> str:
    """The server's queue busy-wait in words (``engines/vllm_spin.py``; measured in RESULTS.md, claim V4)."""
    if spin_s == 0:
        return ("The server's processes do not busy-wait (`TRL_ROLLOUT_CORR_VLLM_SPIN_S=0`): a server at n threads "
                "keeps about n cores busy while it generates.")
    return (f"The server's queue readers busy-wait {spin_s:g} s after each message (vLLM's default is 1 s): a "
            "server at 1 thread keeps about 2 cores busy while it generates.")


def write(results: Path, expected: list[str], design: dict, reach_points: float, results_md: Path | None = None,
          figure: Path = FIGURE, max_foreign_cores: float = 0.10, refuse_load: bool = False) -> str:
    """Rewrite the RESULTS.md section (and the figure, once a cell is kept) for the cells ``expected`` (in run
    order) of ``design``: the committed cells pass ``async_wallclock_checks.select_cells`` first (design, seeds, lag
    check, and with ``refuse_load`` the foreign load above ``max_foreign_cores`` cores); returns the section."""
    loaded = load_cells(results)
    cells, left_out, flagged = checks.select_cells(loaded, expected, design, max_foreign_cores, refuse_load)
    text = section(cells, expected, design, reach_points,
                   {"committed": list(loaded), "left_out": left_out, "flagged": flagged,
                    "revisions": checks.code_revisions(cells)}, figure=figure)
    replace_section(text, BEGIN, END, RESULTS_MD if results_md is None else results_md)
    if cells:
        plot(cells, figure)
    print(text)
    return text
