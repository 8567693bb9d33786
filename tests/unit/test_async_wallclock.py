"""benchmarks/async_wallclock.py, async_wallclock_report.py and async_cells.py (issue 47: accuracy against training
wall clock, synchronous against asynchronous GRPO): the clock that leaves the evaluation out, the checkpoints, the
cells' order and resumability, and the report's statistics, on hand values. No model, no training."""

import json

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def cells():
    return load_script("benchmarks/async_cells.py", "async_cells")


@pytest.fixture(scope="module")
def w(cells):
    return load_script("benchmarks/async_wallclock.py", "async_wallclock")


@pytest.fixture(scope="module")
def chk(w):
    return load_script("benchmarks/async_wallclock_checks.py", "async_wallclock_checks")


@pytest.fixture(scope="module")
def rep(w):
    return load_script("benchmarks/async_wallclock_report.py", "async_wallclock_report")


# ----------------------------------------------------------------------------------------------- time bookkeeping
def test_the_clock_leaves_excluded_intervals_out(cells):
    c = cells.TrainingClock()
    c.start(100.0)
    c.step_begin(101.0)
    assert c.step_end(111.0) == 11.0  # 1 s of set-up before step 1 counts
    c.exclude(111.5, 113.5)  # a weight copy after step 1: 2 s
    c.step_begin(114.0)
    assert c.step_end(124.0) == 22.0  # 24 s since the start, less the 2 s copy
    c.step_begin(125.0)
    c.exclude(130.0, 131.0)  # excluded inside a step: out of that step's seconds too
    assert c.step_end(140.0) == 37.0  # 40 - 3
    assert c.step_s == [10.0, 10.0, 14.0] and c.at_step_end == [11.0, 22.0, 37.0] and c.excluded_s == 3.0


def test_the_clock_refuses_what_it_cannot_account(cells):
    c = cells.TrainingClock()
    with pytest.raises(RuntimeError, match="start"):
        c.step_begin(1.0)
    c.start(10.0)
    with pytest.raises(RuntimeError, match="without step_begin"):
        c.step_end(11.0)
    with pytest.raises(ValueError, match="ends"):
        c.exclude(12.0, 11.0)
    with pytest.raises(ValueError, match="before the clock's start"):
        c.step_begin(9.0)


def test_checkpoint_rows_take_the_clock_at_each_checked_step(w):
    evals = {3: {"scores": [1, 1, 0, 1, 0, 1], "seconds": 9.0}, 0: {"scores": [1, 0, 0, 0], "seconds": 5.0},
             2: {"scores": [1, 1, 0, 0], "seconds": 4.0}}
    rows = w.checkpoint_rows([11.0, 22.0, 37.0], evals, check_size=4)
    assert rows == [{"step": 0, "train_s": 0.0, "correct": 1, "total": 4, "eval_s": 5.0},
                    {"step": 2, "train_s": 22.0, "correct": 2, "total": 4, "eval_s": 4.0},
                    {"step": 3, "train_s": 37.0, "correct": 3, "total": 4, "eval_s": 9.0}]  # final: its first 4
    with pytest.raises(ValueError, match="only 3 steps"):
        w.checkpoint_rows([11.0, 22.0, 37.0], {4: evals[3]}, 4)


def test_checked_steps(w):
    assert w.check_steps(32, 8) == [0, 8, 16, 24, 32]
    assert w.check_steps(32, 8, 2, 16) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 24, 32]  # the defaults: dense, then sparse
    assert w.schedule(w.parse_args([])) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 24, 32]
    assert w.check_steps(10, 8, 4, 16) == [0, 4, 8, 10] and w.check_steps(20, 3, 5, 6) == [0, 5, 9, 12, 15, 18, 20]
    assert w.check_steps(2, 1) == [0, 1, 2] and w.check_steps(5, 8) == [0, 5]
    with pytest.raises(ValueError):
        w.check_steps(0, 8)


def test_the_thread_split_setting_and_bench_async_summarise_it(cells):
    assert cells.SETTINGS["async_d1_t2"] == (1, 2, 1) and cells.SETTINGS["sync_t2"] == (0, 2, 2)
    bench = load_script("benchmarks/bench_async.py", "bench_async")
    run = {"steps": [dict(step_s=99.0, generate_s=0.0, train_s=0.0, wait_s=0.0, publish_s=0.0),
                     dict(step_s=10.0, generate_s=6.0, train_s=8.0, wait_s=1.5, publish_s=0.5)]}
    sync = {"steps": [run["steps"][0], dict(step_s=16.0, generate_s=7.0, train_s=9.0, wait_s=0.0, publish_s=0.0)]}
    table = bench.summarise({"sync_t1": [sync], "async_d1_t2": [run]}).splitlines()
    # own: max(6, 8) / 10 = 0.80; vs sync_t1: max(7, 9) / 10 = 0.90
    assert table[-1] == "| async_d1_t2 | 10.00 | 6.00 | 8.00 | 1.50 | 0.500 | 0.80 | 0.90 |"


def test_step_rows_split_sync_and_async_steps(cells):
    sync = cells.step_rows(0, [10.0, 12.0], [{}, {}], [(0, 2.0), (0, 0.5), (1, 3.0)])
    assert [(r["generate_s"], r["train_s"]) for r in sync] == [(2.5, 7.5), (3.0, 9.0)]
    logs = [{"rollout_async/generate_s": 4.0, "rollout_async/trainer_wait_s": 3.0, "rollout_async/publish_s": 0.5}]
    (row,) = cells.step_rows(1, [10.0], logs, [])
    assert row == dict(step=1, step_s=10.0, generate_s=4.0, wait_s=3.0, publish_s=0.5, train_s=6.5)


# ----------------------------------------------------------------------------------------------- cells
def test_cells_run_seed_by_seed_with_the_order_reversed_on_even_seeds(w):
    assert w.cell_order(2) == ["sync_t1_s1", "sync_t2_s1", "async_d1_s1", "async_d2_s1", "async_d1_t2_s1",
                               "async_d1_t2_s2", "async_d2_s2", "async_d1_s2", "sync_t2_s2", "sync_t1_s2"]
    assert w.parse_cell("async_d2_s3") == ("async_d2", 3) and w.parse_cell("async_d1_t2_s2") == ("async_d1_t2", 2)
    for bad in ("async_d3_s1", "sync_t1_s0", "sync_t1"):
        with pytest.raises(ValueError, match="settings"):
            w.parse_cell(bad)


def test_a_committed_cell_is_skipped_and_one_of_another_design_refused(w, tmp_path):
    design = w.design_of(w.parse_args([]))
    assert design["steps"] == 32 and design["prompts"] == 8 and design["preset"] == "decoupled_k3_rs_token_tis"
    (tmp_path / "sync_t2_s1").mkdir()
    (tmp_path / "sync_t2_s1" / "cell.json").write_text(json.dumps({"design": design}))
    (tmp_path / "async_d1_s1").mkdir()  # a folder without cell.json (an interrupted copy) is not done
    assert w.pending_cells(tmp_path, 1, design) == ["sync_t1_s1", "async_d1_s1", "async_d2_s1", "async_d1_t2_s1"]
    with pytest.raises(RuntimeError, match="steps: 32.*now steps: 16"):
        w.pending_cells(tmp_path, 1, {**design, "steps": 16})
    # a cell committed before server_spin_s was recorded ran with vLLM's 1 s busy-wait: not today's 0
    assert design["server_spin_s"] == 0.0
    legacy = {k: v for k, v in design.items() if k != "server_spin_s"}
    (tmp_path / "sync_t2_s1" / "cell.json").write_text(json.dumps({"design": legacy}))
    with pytest.raises(RuntimeError, match="server_spin_s: 1.0.*now server_spin_s: 0.0"):
        w.pending_cells(tmp_path, 1, design)
    assert w.pending_cells(tmp_path, 1, {**design, "server_spin_s": 1.0})[0] == "sync_t1_s1"


def test_the_worker_gets_the_runners_design(w):
    args = w.parse_args(["--steps", "2", "--eval-size", "8", "--lr", "1e-5", "--engine", "transformers"])
    cmd = w.worker_command("async_d1_s2", args)
    worker = w.parse_args(cmd[2:])
    assert (worker.worker, worker.seed_index) == ("async_d1", 2) and w.design_of(worker) == w.design_of(args)


# ----------------------------------------------------------------------------------------------- the report
def test_time_to_reach_interpolates_between_checks(rep):
    pts = [(0.0, 0.20), (100.0, 0.22), (200.0, 0.30)]
    assert rep.time_to_reach(pts, 0.25) == pytest.approx(137.5)  # 100 + 100 x 0.03 / 0.08
    assert rep.time_to_reach(pts, 0.20) == 0.0 and rep.time_to_reach(pts, 0.31) is None
    with pytest.raises(ValueError):
        rep.time_to_reach([(5.0, 0.1), (4.0, 0.2)], 0.15)
    assert rep.reach_text([100.0, None, 300.0]) == "2 of 3 seeds, median 300 s"
    assert rep.reach_text([None, None, 5.0]) == "1 of 3 seeds, not reached by the median seed"


HAND_DESIGN = {"model": "M", "steps": 32, "prompts": 8, "lr": 3e-5, "preset": "p", "engine": "server",
               "check_size": 128, "check_every": 8, "eval_size": 512}


def _cell(setting, seed, steps, clock, final, curve):
    """A committed cell's fields the report reads: per-step seconds, training seconds at the last step, the final
    score out of 512 and the (train_s, correct of 128) checks."""
    return {"setting": setting, "seed": seed, "design": HAND_DESIGN, "lag_check": [], "code": "abc1234",
            "cpu_use": {"foreign_cores": 0.01}, "steps": [{"step_s": s, "clock_s": clock} for s in steps],
            "final": {"correct": final, "total": 512},
            "checkpoints": [{"step": 8 * i, "train_s": t, "correct": c, "total": 128}
                            for i, (t, c) in enumerate(curve)]}


def _hand_cells():
    """Two seeds of sync_t1, sync_t2 and async_d1 (the values the comments below work through)."""
    return {"sync_t1_s1": _cell("sync_t1", 1, [30, 20, 22, 24], 1000.0, 100, [(0, 25), (500, 30), (1000, 40)]),
            "sync_t1_s2": _cell("sync_t1", 2, [30, 18, 20, 19], 1100.0, 120, [(0, 25), (550, 28), (1100, 31)]),
            "sync_t2_s1": _cell("sync_t2", 1, [28, 18, 18, 18], 900.0, 105, [(0, 25), (450, 30), (900, 38)]),
            "sync_t2_s2": _cell("sync_t2", 2, [28, 19, 19, 19], 1000.0, 130, [(0, 25), (500, 27), (1000, 33)]),
            "async_d1_s1": _cell("async_d1", 1, [25, 16, 16, 16], 800.0, 110, [(0, 25), (400, 35), (800, 36)]),
            "async_d1_s2": _cell("async_d1", 2, [25, 15, 17, 16], 770.0, 140, [(0, 25), (385, 33), (770, 29)])}


def test_log_ratio_interval_and_accuracy_at(rep):
    # ratios 0.8 and 1.25: logs -0.2231 and +0.2231, mean 0 -> geometric mean 1; s.e. 0.2231, t(0.975, 1) 12.706
    # -> exp(+-2.835) = [0.0587, 17.03]
    iv = rep.log_ratio_interval([0.8, 1.25])
    assert (iv.mean, iv.lo, iv.hi, iv.df) == (pytest.approx(1.0), pytest.approx(0.05872, rel=1e-3),
                                              pytest.approx(17.03, rel=1e-3), 1)
    with pytest.raises(ValueError, match="positive"):
        rep.log_ratio_interval([1.0, 0.0])
    pts = [(0.0, 0.20), (100.0, 0.30), (300.0, 0.40)]
    assert rep.accuracy_at(pts, 50.0) == pytest.approx(0.25) and rep.accuracy_at(pts, 200.0) == pytest.approx(0.35)
    assert rep.accuracy_at(pts, 400.0) == 0.40  # finished earlier: held at its last check
    with pytest.raises(ValueError, match="starting at or before"):
        rep.accuracy_at(pts, -1.0)


def test_the_report_on_hand_values(rep):
    cells = _hand_cells()
    groups = rep.by_setting(cells)
    table = rep.setting_rows(groups, 5.0)
    # sync_t1: median steps 22 and 19 -> 20.50; 1050 s; 100 and 120 of 512 = 19.53 and 23.44 %, mean 21.48, s.e.
    # 1.953, t(0.975, 1) 12.706 -> [-3.3, +46.3]; at sync_t2's training s (900, 1000): seed 1 30 + 10 x 400 / 500 =
    # 38 of 128 = 29.69 %, seed 2 28 + 3 x 450 / 550 = 30.45 of 128 = 23.79 %: 26.7; start 25/128 + 5 points =
    # 0.2453: seed 1 reaches it between 500 s (30/128 = 0.2344) and 1000 s (0.3125): 500 + 500 x 0.0109 / 0.0781 =
    # 570 s; seed 2 (31/128 = 0.2422 at 1100 s) never: the median of (570, inf) is inf
    assert table[2] == ("| sync_t1 | 1, 2 | 20.50 | 1050 | 21.5 [-3.3, 46.3] | 26.7 (n = 2) | 1 of 2 seeds, not "
                        "reached by the median seed |")
    # async_d1: steps 16 and 16; 785 s; 110, 140 -> 24.41 %, s.e. 2.930 -> [-12.8, +61.6]; it finished before
    # sync_t2 (800 < 900, 770 < 1000): held at 36 and 29 of 128 -> 25.4 %; seed 1 reaches the target at
    # 400 x 0.05 / 0.0781 = 256 s (35/128 = 0.2734 at 400 s), seed 2 at 385 x 0.05 / 0.0625 = 308 s: median 282
    assert table[4] == ("| async_d1 | 1, 2 | 16.00 | 785 | 24.4 [-12.8, 61.6] | 25.4 (n = 2) | 2 of 2 seeds, "
                        "median 282 s |")
    rows = rep.paired_rows(groups)
    # the A/A null first: training s ratios 900/1000 = 0.9 and 1000/1100 = 0.909: geometric mean 0.9045, log s.e.
    # 0.00499 -> [0.849, 0.964]; finals 105 - 100 and 130 - 120 of 512 = 0.98 and 1.95 points: +1.5, s.e. 0.488
    # -> [-4.7, +7.7]
    assert rows[2] == ("| sync_t2 vs sync_t1 (A/A null: threads only) | 1, 2 | 0.905 [0.849, 0.964] | "
                       "+1.5 [-4.7, +7.7] |")
    # async_d1 vs sync_t2 (the primary comparison): ratios 800/900 = 0.889, 770/1000 = 0.77: logs -0.1178, -0.2614,
    # geometric mean exp(-0.1896) = 0.827, s.e. 0.0718 -> exp(-0.1896 -+ 0.912) = [0.332, 2.060]; finals +5, +10 of
    # 512 -> +1.5 [-4.7, +7.7]
    assert rows[3] == "| async_d1 vs sync_t2 | 1, 2 | 0.827 [0.332, 2.060] | +1.5 [-4.7, +7.7] |"
    # async_d1 vs sync_t1: ratios 0.8 and 0.7: logs -0.2231, -0.3567: 0.748, s.e. 0.0668 -> [0.320, 1.748];
    # finals 10 and 20 of 512 -> +2.9 [-9.5, +15.3]
    assert rows[4] == "| async_d1 vs sync_t1 | 1, 2 | 0.748 [0.320, 1.748] | +2.9 [-9.5, +15.3] |"
    assert rep.paired_rows({"async_d1": groups["async_d1"]}) == [
        "No seed has both a setting and `sync_t2` or `sync_t1` yet: no paired comparison."]
    text = rep.section(cells, [*cells, "sync_t2_s3"], {"model": "M", "steps": 32, "prompts": 8, "lr": 3e-5,
                                                       "preset": "p", "engine": "server", "check_size": 128,
                                                       "check_every": 8, "eval_size": 512}, 5.0)
    assert "Still to run (1): sync_t2_s3." in text and "Not run yet" not in text
    assert not [line for line in text.splitlines() if len(line) > 120]


def test_the_report_writes_its_figure_once_cells_exist(rep, tmp_path):
    cells = _hand_cells()
    for name, cell in cells.items():
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "cell.json").write_text(json.dumps(cell))
    md = tmp_path / "RESULTS.md"
    expected = [c for c in cells if c != "async_d1_s2"]  # async_d1_s2 (seed beyond the request) is ignored
    text = rep.write(tmp_path / "results", expected, HAND_DESIGN, 5.0, results_md=md, figure=tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0 and md.read_text() == f"\n\n{text}\n"
    assert "Left out (1): async_d1_s2: not among the requested cells (--seeds)." in text
    assert "Code revisions: `abc1234` (async_d1_s1, sync_t1_s1, sync_t1_s2, sync_t2_s1, sync_t2_s2)." in text
    assert "| async_d1 | 1 |" in text and "Still to run" not in text


def test_the_section_says_not_run_yet_without_numbers(rep, w, tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# head\n\n{rep.BEGIN}\nold\n{rep.END}\n\ntail\n")
    design = w.design_of(w.parse_args([]))
    text = rep.write(tmp_path / "none", w.cell_order(1), design, 5.0, results_md=md, figure=tmp_path / "f.png")
    body = text.split("\n\n")
    assert body[-2].replace("\n", " ") == (
        "Not run yet: no cell is committed under `benchmarks/results/async_wallclock`. Missing, in run order (5): "
        "sync_t1_s1, sync_t2_s1, async_d1_s1, async_d2_s1, async_d1_t2_s1.")
    assert md.read_text() == f"# head\n\n{text}\n\ntail\n" and not (tmp_path / "f.png").exists()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert rep.BEGIN in (w.ROOT / "benchmarks" / "RESULTS.md").read_text()  # the section exists, generated


# ----------------------------------------------------------------------------------------------- checks, robustness
def test_the_lag_check_wants_the_schedule(chk):
    key = "rollout_corr/policy_lag_max"
    logs = [{"step": t, key: float(min(t - 1, 2))} for t in range(1, 5)]
    assert chk.lag_check(logs, 2, 4) == []
    assert chk.lag_check(logs, 1, 4) == ["step 3: rollout_corr/policy_lag_max 2.0, expected 1",
                                         "step 4: rollout_corr/policy_lag_max 2.0, expected 1"]
    sync = [{"step": 1, key: 0.0}, {"step": 2}]
    assert chk.lag_check(sync, 0, 3) == ["2 logged steps, expected 3", "step 2: rollout_corr/policy_lag_max None, "
                                         "expected 0"]


def test_the_report_keeps_only_checked_cells_of_the_design(chk, w):
    design = w.design_of(w.parse_args([]))
    ok = {"design": design, "lag_check": [], "code": "abc", "cpu_use": {"foreign_cores": 0.02}}
    loaded = {"sync_t1_s1": ok, "sync_t2_s1": {**ok, "code": "def"},
              "async_d1_s1": {**ok, "design": {**design, "lr": 1e-5}},
              "async_d2_s1": {**ok, "lag_check": ["step 2: ..."]},
              "async_d1_t2_s1": {**ok, "cpu_use": {"foreign_cores": 0.3, "loadavg_start": [2.0],
                                                   "loadavg_end": [3.0]}},
              "sync_t1_s4": ok}
    kept, left_out, flagged = chk.select_cells(loaded, w.cell_order(3), design)
    assert list(kept) == ["sync_t1_s1", "sync_t2_s1", "async_d1_t2_s1"]
    assert left_out == ["async_d1_s1: another design (lr 1e-05)", "async_d2_s1: lag check ['step 2: ...']",
                        "sync_t1_s4: not among the requested cells (--seeds)"]
    assert flagged == ["async_d1_t2_s1: other processes used 0.30 cores on average (> 0.1; load 2 -> 3)"]
    kept, left_out, _ = chk.select_cells(loaded, w.cell_order(3), design, refuse_load=True)
    assert "async_d1_t2_s1" not in kept and left_out[2].startswith("async_d1_t2_s1: other processes used 0.30")
    assert chk.code_revisions(kept) == {"abc": ["sync_t1_s1"], "def": ["sync_t2_s1"]}


def test_commit_is_refused_with_uncommitted_cell_files(w, tmp_path):
    assert w.uncommitted_problem("", tmp_path) is None
    text = w.uncommitted_problem("?? r/sync_t1_s1/cell.json\n M r/sync_t2_s1/cell.json\n", tmp_path)
    assert "uncommitted cell files (?? r/sync_t1_s1/cell.json;  M r/sync_t2_s1/cell.json)" in text
    assert f"git add {tmp_path} && git commit" in text


def test_a_cell_past_its_timeout_is_killed_with_its_group(w, tmp_path):
    import subprocess
    import sys

    # the worker starts a child in its group, then hangs: both must be gone after the timeout (8 s: under load the
    # two interpreters may need seconds to start, and at 2 s the log held no pid yet)
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    with pytest.raises(w.CellTimeout, match="no result after 8 s: killed its process group"):
        w.run_worker([sys.executable, "-c", code], tmp_path / "run.log", 8.0)
    child = int((tmp_path / "run.log").read_text().split()[0])
    gone = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    # no such process, or a zombie awaiting init's reap: ps's state letter Z, maybe with modifiers (ZN under nice)
    assert gone[:1] in ("", "Z"), gone
    assert w.run_worker([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "rc.log", 30.0) == 3
    assert w.cell_timeouts(w.parse_args(["--cell-timeout", "500"]))["async_d1_t2"] == 500.0


def test_a_report_of_other_results_stays_in_their_folder(w, rep, tmp_path):
    """--report-only with a smoke run's --results writes RESULTS.md and the figure inside that folder: the committed
    section and figure are left alone (they were overwritten before)."""
    import shutil

    committed_md = (w.ROOT / "benchmarks" / "RESULTS.md").read_bytes()
    spin1 = w.RESULTS.parent / "async_wallclock_spin1"  # the cells run with vLLM's 1 s busy-wait
    kept = sorted(p.parent.name for p in spin1.glob("*/cell.json"))
    assert kept == ["async_d1_t2_s1", "sync_t2_s1"]
    for name in kept:
        shutil.copytree(spin1 / name, tmp_path / name)
    assert w.report_paths(w.RESULTS) == {"results_md": rep.RESULTS_MD, "figure": rep.FIGURE}
    assert w.report_paths(tmp_path) == {"results_md": tmp_path / "RESULTS.md",
                                        "figure": tmp_path / "async_wallclock.png"}
    figure_before = rep.FIGURE.stat().st_mtime_ns if rep.FIGURE.exists() else None
    w.main(["--report-only", "--results", str(tmp_path), "--server-spin-s", "1"])
    text = (tmp_path / "RESULTS.md").read_text()
    assert rep.BEGIN in text and "| sync_t2 | 1 |" in text and "Left out" not in text
    w.main(["--report-only", "--results", str(tmp_path)])  # today's design (no busy-wait): both cells left out
    text = (tmp_path / "RESULTS.md").read_text()
    assert "sync_t2_s1: another design (server_spin_s 1.0)" in text and "| sync_t2 | 1 |" not in text
    assert (tmp_path / "async_wallclock.png").stat().st_size > 0
    assert (w.ROOT / "benchmarks" / "RESULTS.md").read_bytes() == committed_md
    assert (rep.FIGURE.stat().st_mtime_ns if rep.FIGURE.exists() else None) == figure_before


def test_a_spin_the_server_would_refuse_is_refused_at_the_command_line(w, capsys):
    """``--server-spin-s`` becomes the server's ``TRL_ROLLOUT_CORR_VLLM_SPIN_S`` and a design key: a negative or
    non-finite value would only fail inside the server (or match no committed cell), so argparse refuses it."""
    assert w.parse_args(["--server-spin-s", "1"]).server_spin_s == 1.0
    assert w.parse_args([]).server_spin_s == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            w.parse_args(["--server-spin-s", bad])
        assert "TRL_ROLLOUT_CORR_VLLM_SPIN_S=" in capsys.readouterr().err
