"""The asynchronous-depth grid's report (issue 47; ``benchmarks/async_lag_grid.py``): the calibration per candidate
with its rule, then per arm the mean against the start and against on-policy, and every arm paired by seed against
plain TRL at the same depth, each with its 95 % Student-t interval over seeds (n - 1 df; "not established" where the
interval spans zero). Written into benchmarks/RESULTS.md between its own markers (``results_md.replace_section``).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import async_lag_grid as g
import policy_lag_stats as stats
from results_md import replace_section

BEGIN = "<!-- BEGIN async_lag_grid.py output -->"
END = "<!-- END async_lag_grid.py output -->"


def established(iv: stats.Interval) -> str:
    """``established`` when the 95 % interval lies clear of zero, ``not established`` when it spans zero, and
    ``n = 1: no interval`` for one seed."""
    if iv.n < 2 or math.isnan(iv.lo):
        return "n = 1: no interval"
    return "established" if iv.lo > 0 or iv.hi < 0 else "not established"


Vendors = dict[tuple[str, int], dict[int, "str | None"]]


def paired(a: dict[int, float], b: dict[int, float], va: dict[int, str | None] | None = None,
           vb: dict[int, str | None] | None = None) -> list[float]:
    """a - b over the seeds both have ({seed: accuracy}), in seed order; with the cells' CPU vendors ({seed: vendor},
    ``grid_vendors``) only over the seeds whose two cells ran on one vendor (``async_lag_grid.same_vendor``: float32
    bits differ by vendor, so two cells of a seed on two vendors do not share their sampling: not a paired
    difference)."""
    return [a[s] - b[s] for s in sorted(a)
            if s in b and (va is None or vb is None or g.same_vendor(va.get(s), vb.get(s)))]


def across_vendors(a: dict[int, float], b: dict[int, float], va: dict[int, str | None] | None,
                   vb: dict[int, str | None] | None) -> list[int]:
    """The seeds both arms have whose two cells ran on different CPU vendors (left out of ``paired``); none when
    either arm's vendors are not given."""
    if va is None or vb is None:
        return []
    return [s for s in sorted(a) if s in b and not g.same_vendor(va.get(s), vb.get(s))]


def grid_vendors(cand: g.Candidate, results: Path, finals: dict[tuple[str, int], dict[int, float]]) -> Vendors:
    """(method, d) -> {seed: "AMD" / "Intel" / None} for the cells in ``finals`` (``async_lag_grid.cell_vendor``:
    what its ``cell_meta.json`` records, a reused cell's grid's vendor, None where nothing says)."""
    return {(method, d): {seed: g.cell_vendor(cand, f"{method}_d{d}_s{seed}", results) for seed in by_seed}
            for (method, d), by_seed in finals.items()}


def one_vendor(finals: dict[tuple[str, int], dict[int, float]], vendors: Vendors, vendor: str | None
               ) -> dict[tuple[str, int], dict[int, float]]:
    """``finals`` restricted to the cells that ran on ``vendor`` (arms left with no cell dropped): one vendor's
    grid, as issue 47 asks runs to be grouped, next to the pooled table that counts each vendor's seeds."""
    out = {arm: {s: a for s, a in by_seed.items() if vendors.get(arm, {}).get(s) == vendor}
           for arm, by_seed in finals.items()}
    return {arm: by_seed for arm, by_seed in out.items() if by_seed}


def start_check_lines(cand: g.Candidate, results: Path) -> list[str]:
    """One line per committed ``--start-check`` of ``cand`` (``<results>/<candidate>/start_<vendor>.json``): the
    vendor, its score of the start and how many of the items differ from the committed start's scores."""
    out = []
    for path in sorted((results / cand.name).glob("start_*.json")):
        r = json.loads(path.read_text())
        same = ("the same 0/1 score on every item as the committed start's" if r["same_as_start"]
                else f"{len(r['differ_at'])} items scored otherwise than in the committed start's")
        out.append(f"* The start evaluated on {r['vendor'] or 'an unknown vendor'} (`--start-check`, "
                   f"{(r['cpu'] or {}).get('model', '?')}, {r['total']} items at {r.get('max_tokens', '?')} "
                   f"tokens): {r['correct']}/{r['total']}, {same}.")
    return out


def vendor_line(vendors: Vendors) -> str:
    """One sentence: the seeds per CPU vendor, and for a seed whose cells ran on two vendors which cell ran where
    (e.g. ``AMD: seeds 1, 2; Intel: seed 3 (seed 3: trl_d0 on AMD; trl_d2, bypass_d2 on Intel)``)."""
    by: dict[str, set[int]] = {}
    cells: dict[int, dict[str, list[str]]] = {}
    for (method, d), by_seed in sorted(vendors.items(), key=lambda x: (x[0][1], x[0][0])):
        for seed, v in by_seed.items():
            by.setdefault(v or "unknown", set()).add(seed)
            cells.setdefault(seed, {}).setdefault(v or "unknown", []).append(f"{method}_d{d}")
    text = "; ".join(f"{v}: seed{'s' if len(ss) > 1 else ''} {', '.join(map(str, sorted(ss)))}"
                     for v, ss in sorted(by.items()))
    split = ["seed " + str(seed) + ": " + "; ".join(f"{', '.join(names)} on {v}" for v, names in sorted(per.items()))
             for seed, per in sorted(cells.items()) if len(per) > 1]
    return text + (f" ({'; '.join(split)})" if split else "")


def arm_rows(finals: dict[tuple[str, int], dict[int, float]], start: float,
             on_policy: tuple[str, int] = ("trl", 0), vendors: Vendors | None = None) -> list[str]:
    """One table row per arm ((method, d) -> {seed: final accuracy}): seeds, mean final %, minus ``start`` over seeds
    [95 % CI], p, and minus the on-policy arm paired by seed [95 % CI] (n seeds; with ``vendors``, only seeds whose
    two cells ran on one CPU vendor, ``paired``). Points are percentage points."""
    vendors = vendors or {}
    rows = []
    ref = finals.get(on_policy, {})
    for (method, d), by_seed in sorted(finals.items(), key=lambda x: (x[0][1], x[0][0])):
        accs = [by_seed[s] for s in sorted(by_seed)]
        vs_start = stats.fmt_interval(stats.t_interval([a - start for a in accs]), p=True)
        va, vb = vendors.get((method, d)), vendors.get(on_policy)
        diffs = paired(by_seed, ref, va, vb)
        across = across_vendors(by_seed, ref, va, vb)
        if (method, d) == on_policy:
            vs_on = "—"
        elif diffs:
            iv = stats.t_interval(diffs)
            vs_on = f"{stats.fmt_interval(iv)} ({len(diffs)}; {established(iv)})"
            if across:
                vs_on += f"; {len(across)} across vendors left out"
        else:
            vs_on = "no paired seed yet" + (f" ({len(across)} across vendors left out)" if across else "")
        rows.append(f"| {method}_d{d} | {len(accs)} | {100 * statistics.fmean(accs):.1f} | {vs_start} | {vs_on} |")
    return ["| arm (d = async depth, emulated) | seeds | final % mean | minus start [95 % CI], p "
            "| minus on-policy, paired by seed [95 % CI] (seeds; verdict) |", "|---|---|---|---|---|", *rows]


def pair_rows(finals: dict[tuple[str, int], dict[int, float]], depth: int, vendors: Vendors | None = None,
              planned: int | None = None) -> list[str]:
    """Each arm at ``depth`` and the on-policy arm minus plain TRL at ``depth``, paired by seed: mean [95 % CI], p,
    seeds (df), how many seeds A ended above B, and the verdict (``established``). With ``vendors``, a seed whose two
    cells ran on different CPU vendors is left out (``paired``) and counted in the verdict column. With ``planned``
    (the grid's paired seeds), a verdict on fewer seeds is marked interim: a look before the planned end, whose
    "established" a later seed can undo (the t-interval's 95 % holds at the planned n, not at every look)."""
    vendors = vendors or {}
    ref = finals.get(("trl", depth))
    vref = vendors.get(("trl", depth))
    rows = []
    for arm in sorted(a for a in finals if a != ("trl", depth) and a[1] in (0, depth)):
        va = vendors.get(arm)
        diffs = paired(finals[arm], ref or {}, va, vref)
        across = across_vendors(finals[arm], ref or {}, va, vref)
        note = f"; {len(across)} across vendors left out (seed {', '.join(map(str, across))})" if across else ""
        if not diffs:
            rows.append(f"| {arm[0]}_d{arm[1]} - trl_d{depth} | 0 | no paired seed yet | — | —{note} |")
            continue
        iv = stats.t_interval(diffs)
        interim = f" (interim: {iv.n} of {planned} planned seeds)" if planned and iv.n < planned else ""
        rows.append(f"| {arm[0]}_d{arm[1]} - trl_d{depth} | {iv.n} ({iv.df}) | {stats.fmt_interval(iv, p=True)} "
                    f"| {sum(x > 0 for x in diffs)}/{len(diffs)} | {established(iv)}{interim}{note} |")
    return ["| A - B (paired by seed) | seeds (df) | final, points [95 % CI], p | A above B | verdict |",
            "|---|---|---|---|---|", *rows]


def calibration_rows(results: Path, main_grid: Path = g.MAIN_GRID) -> list[str]:
    """Per candidate, in cost order: design, committed on-policy seeds, start, on-policy mean, the gain's mean, s.e.
    and 95 % t-interval over the cells that pass their check, the design's verdict (``async_lag_grid.verdict_of``:
    with its failed seeds counted where they change "measurable") and one cell's core-hours."""
    rows = ["| candidate | start | steps x prompts | seeds (reused) | start % | on-policy % | gain ± s.e., points "
            "| gain [95 % CI] | >= 3 s.e.? verdict | core-h a cell |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cand in g.CANDIDATES:
        gains = g.on_policy_gains(cand, results, main_grid)
        v = g.calibration_verdict(list(gains.values()), cand.max_seeds)
        final = g.verdict_of(cand, results, main_grid)  # the design's verdict: its failed seeds counted where they
        start = statistics.fmean(g.start_scores(cand, main_grid))  # would change "measurable"
        reused = [f"s{s}: {rel}" for s, rel in cand.reuse if s in gains]
        on = f"{100 * (start + v.mean):.1f}" if v.n else "—"
        gain = f"{100 * v.mean:+.1f} ± {100 * v.se:.1f}" if v.n > 1 else ("—" if not v.n else f"{100 * v.mean:+.1f}")
        ci = stats.fmt_interval(v.interval) if v.interval else "—"
        rows.append(f"| {cand.name} | {cand.start} | {cand.steps} x {cand.prompts} | {v.n}"
                    f"{' (' + '; '.join(reused) + ')' if reused else ''} | {100 * start:.1f} | {on} | {gain} | {ci} "
                    f"| {final.status}: {final.reason} | {cand.cell_h:.2f} |")
    return rows


def calibration_left_out(results: Path, main_grid: Path = g.MAIN_GRID) -> list[str]:
    """Per candidate with on-policy cells left out (``cell_problems``): each with its final accuracy and why, and the
    gain with them counted ("both ways": leaving out a seed that failed a check can select the seeds that learned).
    Empty when none is left out."""
    out = []
    for cand in g.CANDIDATES:
        start = statistics.fmean(g.start_scores(cand, main_grid))
        every, left = g.counted_gains(cand, results, main_grid), []
        for seed, gain in every.items():
            problems = g.cell_problems(cand, f"trl_d0_s{seed}", results)
            if problems:
                more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
                left.append(f"`trl_d0_s{seed}` {100 * (start + gain):.1f} % ({problems[0]}{more})")
        if not left:
            continue
        v = g.calibration_verdict(list(every.values()), cand.max_seeds)
        gain = (f"{stats.fmt_interval(v.interval)} points (95 % CI; s.e. {100 * v.se:.1f})" if v.interval
                else f"{100 * v.mean:+.1f} points")
        out.append(f"* {cand.name}: left out of the table above: {', '.join(left)}. Counted, the gain over "
                   f"{v.n} seeds is {gain}: {v.status} ({v.reason}).")
    return out


def k3_above_lines(results: Path, engine_kl_max: float = 0.03) -> list[str]:
    """Per committed cell of our own (``results/<candidate>/<cell>``, in candidate order) with lag-0 steps whose
    ``rollout_corr/k3_kl`` is above ``engine_kl_max`` (``async_lag_grid.lag0_k3_above``): those steps and the median
    over its lag-0 steps, the number the check bounds. Informational, not a failure (a cell whose median is above
    the bound fails, and its line says so). Empty when no cell has such a step."""
    out = []
    for cand in g.CANDIDATES:
        for folder in sorted(p for p in (results / cand.name).glob("*_d*_s*") if g.committed(p)):
            depth = g.parse_cell(folder.name)[1]
            steps = g.cell_steps(folder)
            above = g.lag0_k3_above(steps, depth, engine_kl_max)
            if not above:
                continue
            lag0 = [kl for _, kl in g.lag0_k3(steps, depth) if kl is not None and math.isfinite(kl)]
            med = statistics.median(lag0)
            fails = "; above the bound: the cell fails its check" if med > engine_kl_max else ""
            out.append(f"* `{cand.name}/{folder.name}`: " + ", ".join(f"step {s} {kl:.3f}" for s, kl in above)
                       + f" (median over its {len(lag0)} lag-0 steps {med:.3f}{fails})")
    return out


def grid_finals(cand: g.Candidate, results: Path, depth_set: set[int], engine_kl_max: float = 0.03
                ) -> tuple[dict[tuple[str, int], dict[int, float]], list[str]]:
    """``cand``'s committed cells at the depths in ``depth_set``: (method, d) -> {seed: final accuracy}, leaving out
    the cells that fail their check (``async_lag_grid.cell_problems``: the lag check recomputed from their
    ``log.jsonl``, which must hold every step, and ``cell_meta.json``'s ``starts_at_start``, the step-0 check); those
    are listed in the second value."""
    finals: dict[tuple[str, int], dict[int, float]] = {}
    failed = []
    names = {p.name for p in (results / cand.name).glob("*_d*_s*") if (p / "eval.json").exists()}
    names |= {f"trl_d0_s{s}" for s, _ in cand.reuse}
    for name in sorted(names):
        method, d, seed = g.parse_cell(name)
        folder = g.cell_folder(cand, name, results)
        acc = g.final_accuracy(folder)
        if d not in depth_set or acc is None:
            continue
        problems = g.cell_problems(cand, name, results, engine_kl_max)  # our own cells' check (none for reused)
        if problems:
            failed.append(f"{name} ({'; '.join(problems[:2])})")
            continue
        finals.setdefault((method, d), {})[seed] = acc
    return finals, failed


def report(results: Path, depth: int = g.DEPTH, followup: int = 1, min_seeds: int = g.MIN_GRID_SEEDS,
           main_grid: Path = g.MAIN_GRID) -> str:
    """The markdown section (between ``BEGIN`` and ``END``) from the committed cells under ``results``."""
    lines = [BEGIN, "", f"### Asynchronous depth d = {depth}, emulated (`benchmarks/async_lag_grid.py`, issue 47)", "",
             " ".join(f"""Every cell is the policy-lag main job with the engine's weights d optimizer steps behind the
             learner: EMULATED (`VLLMCPURollout(async_depth=d)` through the recipe's `--rollout_async_depth`: step s's
             batch from the weights of step s - d exactly, one process, one torch thread, nothing overlapped; the
             engine's one sampling stream), not the real pipeline. d = 0 is on-policy. A cell counts when its lag
             check passes: the emulated schedule's lags exact at every step, and the median `k3_kl` (bf16 engine
             against the float32 trainer) over its lag-0 steps at most 0.03 nats/token (the median since 2026-12-07,
             before any base_32x8 cell). Calibration first: on-policy
             plain TRL minus the start must be at least {g.RULE_SE:g} s.e. over seeds (n >= {g.MIN_CALIBRATION_SEEDS};
             candidates in cost order, committed cells reused where they ran the same recipe). Then the arms at
             d = {depth} for max({min_seeds}, the calibration's) paired seeds; plain TRL and bypass at
             d = {followup} only if plain TRL's d = {depth} lag effect is established. Mean [95 % Student-t
             interval, n - 1 df] over seeds, in points of held-out accuracy (512 items); "not established" where
             the interval spans zero.""".split()), "", "Calibration:", "", *calibration_rows(results, main_grid)]
    left_out = calibration_left_out(results, main_grid)
    if left_out:
        lines += ["", "On-policy cells left out (a failed check), and the calibration with them counted:", "",
                  *left_out]
    above = k3_above_lines(results)
    if above:
        lines += ["", "Lag-0 steps above the k3_kl bound 0.03 (informational, not a failure: the lag check bounds the "
                  "median over a cell's lag-0 steps, `async_lag_grid.async_lag_check`):", "", *above]
    chosen = next((c for c in g.CANDIDATES if g.verdict_of(c, results, main_grid).status == g.MEASURABLE), None)
    shown = [c for c in g.CANDIDATES if c is chosen or any((results / c.name).glob(f"*_d{depth}_s*"))]
    if not shown:
        lines += ["", "No candidate is calibrated yet: the grid has not started."]
    for cand in shown:
        finals, failed = grid_finals(cand, results, {0, depth, followup})
        vendors = grid_vendors(cand, results, finals)
        start = statistics.fmean(g.start_scores(cand, main_grid))
        planned = g.grid_seeds(g.verdict_of(cand, results, main_grid), min_seeds) if cand is chosen else None
        lines += ["", f"Grid in design `{cand.name}` ({cand.start}, {cand.steps} steps x {cand.prompts} prompts; "
                  f"start {100 * start:.1f} %):", "", *arm_rows(finals, start, vendors=vendors), "",
                  *pair_rows(finals, depth, vendors, planned)]
        kinds = {v for by_seed in vendors.values() for v in by_seed.values()}
        if len(kinds) > 1:
            lines += ["", f"CPU vendors of the cells: {vendor_line(vendors)}. Two cells of a seed are paired only "
                      "on one vendor (float32 bits differ by vendor); the start's 512 scores are the AMD base "
                      "model's, and a cell counts only when its step-0 check (128 of them) matches them exactly. A "
                      "pair split across vendors stays unpaired (a cell's folder holds one run, on one vendor)."]
            checks = start_check_lines(cand, results)
            lines += (["", *checks] if checks else []) + ["", "The same paired differences on each vendor alone:"]
            for vendor in sorted(kinds, key=str):
                lines += ["", f"On {vendor or 'an unknown vendor'} only:", "",
                          *pair_rows(one_vendor(finals, vendors, vendor), depth, planned=planned)]
        if failed:
            lines += ["", "Left out (lag check failed): " + "; ".join(failed) + "."]
        if cand is chosen:
            n = g.grid_seeds(g.verdict_of(cand, results, main_grid), min_seeds)
            missing = [c for c in g.grid_cells(n, depth) if not g.committed(g.cell_folder(cand, c, results))]
            if missing:
                lines += ["", f"Not run yet ({len(missing)} of the grid's cells): {', '.join(missing)}."]
    lines += ["", END]
    return "\n".join(lines)


def write(text: str, path: Path = Path(__file__).resolve().parent / "RESULTS.md") -> None:
    """Replace (or append) the section in ``path``."""
    replace_section(text, BEGIN, END, path)
