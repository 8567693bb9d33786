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
    assert w.check_steps(2, 1) == [0, 1, 2] and w.check_steps(5, 8) == [0, 5]
    with pytest.raises(ValueError):
        w.check_steps(0, 8)


def test_step_rows_split_sync_and_async_steps(cells):
    sync = cells.step_rows(0, [10.0, 12.0], [{}, {}], [(0, 2.0), (0, 0.5), (1, 3.0)])
    assert [(r["generate_s"], r["train_s"]) for r in sync] == [(2.5, 7.5), (3.0, 9.0)]
    logs = [{"rollout_async/generate_s": 4.0, "rollout_async/trainer_wait_s": 3.0, "rollout_async/publish_s": 0.5}]
    (row,) = cells.step_rows(1, [10.0], logs, [])
    assert row == dict(step=1, step_s=10.0, generate_s=4.0, wait_s=3.0, publish_s=0.5, train_s=6.5)


# ----------------------------------------------------------------------------------------------- cells
def test_cells_run_seed_by_seed_with_the_order_reversed_on_even_seeds(w):
    assert w.cell_order(2) == ["sync_t1_s1", "sync_t2_s1", "async_d1_s1", "async_d2_s1",
                               "async_d2_s2", "async_d1_s2", "sync_t2_s2", "sync_t1_s2"]
    assert w.parse_cell("async_d2_s3") == ("async_d2", 3)
    for bad in ("async_d3_s1", "sync_t1_s0", "sync_t1"):
        with pytest.raises(ValueError, match="settings"):
            w.parse_cell(bad)


def test_a_committed_cell_is_skipped_and_one_of_another_design_refused(w, tmp_path):
    design = w.design_of(w.parse_args([]))
    assert design["steps"] == 32 and design["prompts"] == 8 and design["preset"] == "decoupled_k3_rs_token_tis"
    (tmp_path / "sync_t2_s1").mkdir()
    (tmp_path / "sync_t2_s1" / "cell.json").write_text(json.dumps({"design": design}))
    (tmp_path / "async_d1_s1").mkdir()  # a folder without cell.json (an interrupted copy) is not done
    assert w.pending_cells(tmp_path, 1, design) == ["sync_t1_s1", "async_d1_s1", "async_d2_s1"]
    with pytest.raises(RuntimeError, match="steps: 32.*now steps: 16"):
        w.pending_cells(tmp_path, 1, {**design, "steps": 16})


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


def _cell(setting, seed, steps, clock, final, curve):
    """A committed cell's fields the report reads: per-step seconds, training seconds at the last step, the final
    score out of 512 and the (train_s, correct of 128) checks."""
    return {"setting": setting, "seed": seed, "steps": [{"step_s": s, "clock_s": clock} for s in steps],
            "final": {"correct": final, "total": 512},
            "checkpoints": [{"step": 8 * i, "train_s": t, "correct": c, "total": 128}
                            for i, (t, c) in enumerate(curve)]}


def _hand_cells():
    """Two seeds of sync_t1 and async_d1 (the values the comments below work through)."""
    return {"sync_t1_s1": _cell("sync_t1", 1, [30, 20, 22, 24], 1000.0, 100, [(0, 25), (500, 30), (1000, 40)]),
            "sync_t1_s2": _cell("sync_t1", 2, [30, 18, 20, 19], 1100.0, 120, [(0, 25), (550, 28), (1100, 31)]),
            "async_d1_s1": _cell("async_d1", 1, [25, 16, 16, 16], 800.0, 110, [(0, 25), (400, 35), (800, 36)]),
            "async_d1_s2": _cell("async_d1", 2, [25, 15, 17, 16], 770.0, 140, [(0, 25), (385, 33), (770, 29)])}


def test_the_report_on_hand_values(rep):
    cells = _hand_cells()
    groups = rep.by_setting(cells)
    table = rep.setting_rows(groups, 5.0)
    # sync_t1: median steps 22 and 19 -> 20.50; 1050 s; 100 and 120 of 512 = 19.53 and 23.44 %, mean 21.48, s.e.
    # 1.953, t(0.975, 1) 12.706 -> [-3.3, +46.3]; start 25/128 + 5 points = 0.2453: seed 1 reaches it between 500 s
    # (30/128 = 0.2344) and 1000 s (0.3125): 500 + 500 x 0.0109 / 0.0781 = 570 s; seed 2 (31/128 = 0.2422 at 1100 s)
    # never: the median of (570, inf) is inf
    assert table[2] == ("| sync_t1 | 1, 2 | 20.50 | 1050 | 21.5 [-3.3, 46.3] | 1 of 2 seeds, not reached by the "
                        "median seed |")
    # async_d1: steps 16 and 16; 785 s; 110, 140 -> 24.41 %, s.e. 2.930 -> [-12.8, +61.6]; seed 1 reaches the target
    # at 400 x 0.05 / 0.0781 = 256 s (35/128 = 0.2734 at 400 s), seed 2 at 385 x 0.05 / 0.0625 = 308 s: median 282
    assert table[3] == "| async_d1 | 1, 2 | 16.00 | 785 | 24.4 [-12.8, 61.6] | 2 of 2 seeds, median 282 s |"
    # paired: 10 and 20 of 512 = 1.953 and 3.906 points, mean 2.93, s.e. 0.977 -> [-9.5, +15.3]; training s ratios
    # 0.8 and 0.7: 0.750, s.e. 0.05 -> [0.115, 1.385]
    assert rep.paired_rows(groups)[2] == "| async_d1 | 1, 2 | +2.9 [-9.5, +15.3] | 0.750 [0.115, 1.385] |"
    assert rep.paired_rows({"async_d1": groups["async_d1"]}) == [
        "No seed has both `sync_t1` and another setting yet: no paired difference."]
    text = rep.section(cells, [*cells, "sync_t2_s1"], {"model": "M", "steps": 32, "prompts": 8, "lr": 3e-5,
                                                       "preset": "p", "engine": "server", "check_size": 128,
                                                       "check_every": 8, "eval_size": 512}, 5.0)
    assert "Still to run (1): sync_t2_s1." in text and "Not run yet" not in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_the_report_writes_its_figure_once_cells_exist(rep, tmp_path):
    cells = _hand_cells()
    for name, cell in cells.items():
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "cell.json").write_text(json.dumps(cell))
    md = tmp_path / "RESULTS.md"
    design = {"model": "M", "steps": 32, "prompts": 8, "lr": 3e-5, "preset": "p", "engine": "server",
              "check_size": 128, "check_every": 8, "eval_size": 512}
    text = rep.write(tmp_path / "results", list(cells), design, 5.0, results_md=md, figure=tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0 and md.read_text() == f"\n\n{text}\n"


def test_the_section_says_not_run_yet_without_numbers(rep, w, tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# head\n\n{rep.BEGIN}\nold\n{rep.END}\n\ntail\n")
    design = w.design_of(w.parse_args([]))
    text = rep.write(tmp_path / "none", w.cell_order(1), design, 5.0, results_md=md, figure=tmp_path / "f.png")
    body = text.split("\n\n")
    assert body[-2].replace("\n", " ") == (
        "Not run yet: no cell is committed under `benchmarks/results/async_wallclock`. Missing, in run order (4): "
        "sync_t1_s1, sync_t2_s1, async_d1_s1, async_d2_s1.")
    assert md.read_text() == f"# head\n\n{text}\n\ntail\n" and not (tmp_path / "f.png").exists()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert rep.BEGIN in (w.ROOT / "benchmarks" / "RESULTS.md").read_text()  # the section exists, generated
