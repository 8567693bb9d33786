"""benchmarks/async_lag_grid.py and async_lag_report.py (issue 47, the emulated d = 2 grid): the calibration's
decision rule, the cells' names, flags and lag check, and the report's rows, on hand-computed values."""

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def g():
    return load_script("benchmarks/async_lag_grid.py", "async_lag_grid")


@pytest.fixture(scope="module")
def rep(g):
    return load_script("benchmarks/async_lag_report.py", "async_lag_report")


def test_the_main_grids_on_policy_cells_fail_the_rule(g):
    # trl_k1_s1-4 end at 221, 263, 192, 181 of 512 from the warm start's 203: +18, +60, -11, -22 items. Mean 11.25,
    # squared deviations 45.5625 + 2376.5625 + 495.0625 + 1105.5625 = 4022.75, sd sqrt(4022.75 / 3) = 36.618 items,
    # s.e. 18.309 items = 3.58 points: the mean (2.2 points) is 0.61 s.e.; (3 x 36.618 / 11.25)^2 = 95.35 -> 96 seeds
    v = g.calibration_verdict([x / 512 for x in (18, 60, -11, -22)], max_seeds=4)
    assert v.status == g.NOT_MEASURABLE and v.n == 4 and v.seeds_needed == 96
    assert v.mean == pytest.approx(11.25 / 512) and v.se == pytest.approx(math.sqrt(4022.75 / 3) / 2 / 512)
    assert v.reason == "mean +2.2 < 3 x s.e. 3.6 points; 96 seeds needed, over the 4 allowed"
    assert g.calibration_verdict([x / 512 for x in (18, 60, -11, -22)], max_seeds=100).status == g.MORE_SEEDS


def test_the_rule_passes_at_three_standard_errors(g):
    v = g.calibration_verdict([0.20, 0.25, 0.30], max_seeds=8)  # mean 0.25, sd 0.05, s.e. 0.0289: 8.7 s.e.
    assert v.status == g.MEASURABLE and v.seeds_needed == 3  # (3 x 0.05 / 0.25)^2 = 0.36, at least the 3 minimum
    assert v.reason == "mean +25.0 >= 3 x s.e. 2.9 points"
    assert g.grid_seeds(v) == 5  # never fewer than 5 paired seeds


def test_the_rule_asks_for_the_seeds_the_spread_needs(g):
    # mean 0.1, sd 0.1, s.e. 0.0577: 1.7 s.e.; (3 x 0.1 / 0.1)^2 = 9 seeds
    assert g.calibration_verdict([0.10, 0.20, 0.00], max_seeds=10).status == g.MORE_SEEDS
    assert g.calibration_verdict([0.10, 0.20, 0.00], max_seeds=10).seeds_needed == 9
    assert g.calibration_verdict([0.10, 0.20, 0.00], max_seeds=8).status == g.NOT_MEASURABLE
    many = g.calibration_verdict([0.10, 0.20, 0.00, 0.10, 0.20, 0.00, 0.10, 0.20, 0.00], max_seeds=12)
    assert many.status == g.MEASURABLE and g.grid_seeds(many) == 9  # the grid takes the calibration's 9 seeds
    assert g.calibration_verdict([-0.05, 0.01, -0.02], max_seeds=8).status == g.NOT_MEASURABLE  # no gain
    assert g.calibration_verdict([0.3], max_seeds=8).status == g.MORE_SEEDS  # 1 of the 3 seeds
    assert g.calibration_verdict([0.3, 0.3], max_seeds=8).status == g.MORE_SEEDS  # no spread yet, still 2 < 3
    with pytest.raises(ValueError, match="min_seeds"):
        g.calibration_verdict([0.1, 0.2, 0.3], max_seeds=2)
    with pytest.raises(ValueError, match="finite"):
        g.calibration_verdict([0.1, math.nan, 0.3], max_seeds=8)


def test_lag_effect_needs_an_interval_clear_of_zero(g):
    on = {1: 0.40, 2: 0.41, 3: 0.39}
    assert g.lag_effect_established({1: 0.30, 2: 0.32, 3: 0.28}, on)  # -0.10, -0.09, -0.11
    assert not g.lag_effect_established({1: 0.30, 2: 0.45, 3: 0.38}, on)  # -0.10, +0.04, -0.01
    assert not g.lag_effect_established({1: 0.30}, on)  # one paired seed: no interval


def test_cell_names_and_flags(g):
    import argparse
    from pathlib import Path

    assert g.parse_cell("rs_engine_d2_s3") == ("rs_engine", 2, 3)
    for bad in ("trl_k1_s1", "foo_d2_s1", "trl_d2", "trl_d2_s0"):
        with pytest.raises(ValueError, match="<method>_d<depth>_s<seed>"):
            g.parse_cell(bad)
    args = argparse.Namespace(lr=3e-5, main_out="/o/policy_lag")
    base = g.candidate("base_16x4")
    flags = g.cell_flags("rs_engine_d2_s3", base, Path("/o/x"), args)
    value = {f: v for f, v in zip(flags, flags[1:])}
    assert value["--rollout_async_depth"] == "2" and "--rollout_sync_interval" not in value
    assert value["--seed"] == "44" and value["--max_steps"] == "16" and value["--per_device_train_batch_size"] == "16"
    assert value["--model_name_or_path"] == g.pl.BASE_MODEL and value["--rollout_rs_on"] == "engine"
    assert value["--config"].endswith("cpu_smollm2_decoupled.yaml") and value["--policy_lag_split"] == "true"
    on = {f: v for f, v in zip(*(lambda x: (x, x[1:]))(g.cell_flags("trl_d0_s1", g.candidate("warm_32x8"),
                                                                        Path("/o/y"), args)))}
    assert on["--rollout_sync_interval"] == "1" and "--rollout_async_depth" not in on
    assert on["--model_name_or_path"] == "/o/policy_lag/warmstart" and on["--per_device_train_batch_size"] == "32"
    assert g.grid_cells(2)[:5] == ["trl_d0_s1", "trl_d2_s1", "bypass_d2_s1", "tis_d2_s1", "rs_engine_d2_s1"]
    assert g.followup_cells(2, 1) == ["trl_d1_s1", "bypass_d1_s1", "trl_d1_s2", "bypass_d1_s2"]
    with pytest.raises(ValueError, match="base_32x8"):
        g.candidate("base_64x2")


def test_async_lag_check_follows_the_emulated_schedule(g):
    good = [{"step": t, "rollout_corr/policy_lag_max": float(min(t - 1, 2)),
             "rollout_corr/policy_lag_mean": float(min(t - 1, 2)), "rollout_corr/k3_kl": 0.002 if t == 1 else 0.5}
            for t in range(1, 6)]
    assert g.async_lag_check(good, 2, 0.03) == []
    bad = [dict(r) for r in good]
    bad[3]["rollout_corr/policy_lag_mean"] = 1.5  # step 4 should be lag 2 on every row
    bad[0]["rollout_corr/k3_kl"] = 0.04  # above the engine-mismatch bound at the lag-0 step
    assert g.async_lag_check(bad, 2, 0.03) == ["step 4: policy lag max/mean (2.0, 1.5), expected 2",  # the one lag-0
                                               "lag-0 k3_kl median 0.04 over 1 lag-0 steps (later half 0.04 over 1), "
                                               "above the bound 0.03"]  # one lag-0 step: both medians are that step
    assert g.async_lag_check(good, 0, 0.03)[0] == "step 2: policy lag max/mean (1.0, 1.0), expected 0"


def _on_policy(k3):
    """Logged steps of an on-policy (d = 0) cell: lag 0 at every step, k3_kl ``k3[t - 1]`` at step t (None: none)."""
    return [{"step": t, "rollout_corr/policy_lag_max": 0, "rollout_corr/policy_lag_mean": 0,
             **({} if kl is None else {"rollout_corr/k3_kl": kl})} for t, kl in enumerate(k3, start=1)]


def test_a_few_lag0_spikes_pass_when_the_median_is_under_the_bound(g):
    """Rule of 2026-12-07: the KL part bounds the median over the lag-0 steps. 0.002, 0.05, 0.004, 0.06, 0.003 sort to
    0.002, 0.003, 0.004, 0.05, 0.06: median 0.004 <= 0.03, so the cell passes (the old every-step rule failed it at
    steps 2 and 4); those two steps stay visible, informational."""
    steps = _on_policy([0.002, 0.05, 0.004, 0.06, 0.003])
    assert g.async_lag_check(steps, 0, 0.03, expected_steps=5) == []
    assert g.lag0_k3_above(steps, 0, 0.03) == [(2, 0.05), (4, 0.06)]
    assert g.lag0_k3(steps, 0) == [(1, 0.002), (2, 0.05), (3, 0.004), (4, 0.06), (5, 0.003)]


def test_a_median_above_the_bound_fails(g):
    # 0.02, 0.04, 0.05, 0.01, 0.035 sort to 0.01, 0.02, 0.035, 0.04, 0.05: median 0.035 > 0.03 (one message, not three)
    steps = _on_policy([0.02, 0.04, 0.05, 0.01, 0.035])
    # its later half (steps 3-5): 0.05, 0.01, 0.035, median 0.035 > 0.03 as well
    assert g.async_lag_check(steps, 0, 0.03) == [
        "lag-0 k3_kl median 0.035 over 5 lag-0 steps (later half 0.035 over 3), above the bound 0.03"]
    # six steps: 0.01, 0.02, 0.04, 0.05, 0.06, 0.07: median (0.04 + 0.05) / 2 = 0.045
    six = _on_policy([0.07, 0.01, 0.05, 0.02, 0.06, 0.04])
    # its later half (steps 4-6): 0.02, 0.06, 0.04, median 0.04
    assert g.async_lag_check(six, 0, 0.03) == [
        "lag-0 k3_kl median 0.045 over 6 lag-0 steps (later half 0.04 over 3), above the bound 0.03"]
    assert g.lag0_k3_above(six, 0, 0.03) == [(1, 0.07), (3, 0.05), (5, 0.06), (6, 0.04)]
    # at d = 2 only step 1 is at lag 0: its k3 alone is the median; the stale steps' k3 (lag in it) is not bounded
    lagged = [dict(r, **{"rollout_corr/policy_lag_max": min(t, 2), "rollout_corr/policy_lag_mean": min(t, 2)})
              for t, r in enumerate(_on_policy([0.001, 0.9, 0.9]))]
    assert g.async_lag_check(lagged, 2, 0.03) == [] and g.lag0_k3(lagged, 2) == [(1, 0.001)]


def test_a_sync_missed_after_the_middle_fails_on_the_later_half(g):
    """Ten steps at 0.005, then an engine left on old weights: 0.02, 0.04, 0.08, 0.15, 0.3, 0.6. The whole cell's
    median is the 8th and 9th sorted values' mean, 0.005, under 0.03; its later half (steps 9-16: 0.005, 0.005,
    0.02, 0.04, 0.08, 0.15, 0.3, 0.6) has median (0.04 + 0.08) / 2 = 0.06, over it: the cell fails."""
    steps = _on_policy([0.005] * 10 + [0.02, 0.04, 0.08, 0.15, 0.3, 0.6])
    assert g.async_lag_check(steps, 0, 0.03, expected_steps=16) == [
        "lag-0 k3_kl median 0.005 over 16 lag-0 steps (later half 0.06 over 8), above the bound 0.03"]


def test_a_lag0_step_without_a_finite_k3_fails(g):
    """A lag-0 step with no k3_kl still fails (as before); a NaN one fails too (the old rule let NaN pass: NaN > 0.03
    is false). The median is then over the finite ones: 0.002, 0.004, 0.003 -> 0.003, under the bound."""
    assert g.async_lag_check(_on_policy([0.002, None, 0.004, 0.003]), 0, 0.03) == [
        "step 2: lag 0 but no finite k3_kl (None)"]
    assert g.async_lag_check(_on_policy([0.002, 0.004, math.nan, 0.003]), 0, 0.03) == [
        "step 3: lag 0 but no finite k3_kl (nan)"]
    assert g.async_lag_check(_on_policy([None]), 2, 0.03) == ["step 1: lag 0 but no finite k3_kl (None)"]


def test_the_committed_cells_under_the_median_rule(g):
    """Real data. base_16x4 ``trl_d0_s3`` (schedule exact, lag-0 k3 0.032, 0.042, 0.050, 0.062 at steps 3, 8, 9, 10
    during its zero-reward stretch; median over 16 steps 0.0107) now passes; the never-synced ``trl_k32_s1`` and
    ``bypass_k32_s1``, their 32 steps read as lag 0, fail on their medians 0.9272 and 0.1593."""
    base, res = g.candidate("base_16x4"), g.RESULTS / "async_lag"
    s3 = g.cell_steps(res / "base_16x4" / "trl_d0_s3")
    assert g.async_lag_check(s3, 0, 0.03, expected_steps=16) == [] and g.cell_problems(base, "trl_d0_s3", res) == []
    assert [(s, round(kl, 3)) for s, kl in g.lag0_k3_above(s3, 0, 0.03)] == [
        (3, 0.032), (8, 0.042), (9, 0.050), (10, 0.062)]
    for cell, median, late in (("trl_k32_s1", "0.9272", "1.632"), ("bypass_k32_s1", "0.1593", "0.1831")):
        k3 = [r["rollout_corr/k3_kl"] for r in g.cell_steps(g.MAIN_GRID / cell)]
        assert len(k3) == 32
        assert g.async_lag_check(_on_policy(k3), 0, 0.03) == [
            f"lag-0 k3_kl median {median} over 32 lag-0 steps (later half {late} over 16), above the bound 0.03"]
    # base_16x4 with seed 3 counted (it passes now): 135, 185, 80, 149 of 512 against the start's 99: +36, +86, -19,
    # +50 items, mean 38.25, sd sqrt(5700.75 / 3) = 43.59, s.e. 21.80 items = 4.3 points; (3 sd / mean)^2 = 11.7 -> 12
    # seeds, over the 8 allowed: still not measurable, with every seed counted
    assert g.on_policy_gains(base, res) == pytest.approx({1: 36 / 512, 2: 86 / 512, 3: -19 / 512, 4: 50 / 512})
    v = g.verdict_of(base, res)
    assert v.status == g.NOT_MEASURABLE and v.n == 4 and v.seeds_needed == 12
    assert v.reason == "mean +7.5 < 3 x s.e. 4.3 points; 12 seeds needed, over the 8 allowed"


FINALS = {("trl", 0): {1: 0.40, 2: 0.44, 3: 0.42}, ("trl", 2): {1: 0.30, 2: 0.36, 3: 0.33},
          ("bypass", 2): {1: 0.38, 2: 0.37, 3: 0.45}}


def test_pair_rows_paired_by_seed_with_t_intervals(rep):
    # bypass - trl at d = 2: +0.08, +0.01, +0.12: mean 0.07, sd sqrt(0.0062 / 2) = 0.05568, s.e. 0.03215; t(0.975, 2)
    # = 4.302653: half 0.1383 -> [-6.8, +20.8]; t = 2.1776, p = 1 - t / sqrt(2 + t^2) = 0.16. trl_d0 - trl_d2: +0.10,
    # +0.08, +0.09: s.e. 0.005774, half 0.02484 -> [+6.5, +11.5]; t = 15.59, p = 0.0041
    rows = rep.pair_rows(FINALS, 2)
    assert rows[2] == "| bypass_d2 - trl_d2 | 3 (2) | +7.0 [-6.8, +20.8], p 0.16 | 3/3 | not established |"
    assert rows[3] == "| trl_d0 - trl_d2 | 3 (2) | +9.0 [+6.5, +11.5], p 0.0041 | 3/3 | established |"


def test_arm_rows_against_start_and_on_policy(rep):
    rows = rep.arm_rows(FINALS, 0.20)
    # trl_d0 - start: 0.20, 0.24, 0.22: s.e. 0.011547, half 0.04968 -> [+17.0, +27.0]; t = 19.05, p = 0.0027
    assert rows[2] == "| trl_d0 | 3 | 42.0 | +22.0 [+17.0, +27.0], p 0.0027 | — |"
    assert rows[4].startswith("| trl_d2 | 3 | 33.0 | +13.0 [") and rows[4].endswith(
        "| -9.0 [-11.5, -6.5] (3; established) |")
    one = rep.arm_rows({("trl", 0): {1: 0.4}, ("tis", 2): {2: 0.3}}, 0.2)
    assert one[3] == "| tis_d2 | 1 | 30.0 | +10.0 (n = 1: no interval) | no paired seed yet |"


def _cell(folder, acc, scores, depth=None, steps=16, kl=0.001):
    """A committed cell: eval.json, and with ``depth`` the emulated schedule's log.jsonl (``steps`` steps, k3_kl
    ``kl`` at every step, or ``kl[t - 1]`` at step t for a list) and cell_meta.json, as ``run_cell`` commits them."""
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps({"after": {"accuracy": acc, "scores": scores}}))
    if depth is not None:
        log = [{"step": t, "loss": 0.0, "step_time": 1.0, "rollout_corr/policy_lag_max": min(t - 1, depth),
                "rollout_corr/policy_lag_mean": min(t - 1, depth),
                "rollout_corr/k3_kl": kl[t - 1] if isinstance(kl, list) else kl}
               for t in range(1, steps + 1)]
        (folder / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log) + "\n")
        (folder / "cell_meta.json").write_text(json.dumps({"starts_at_start": True}))


def _main_grid(g, tmp_path, monkeypatch):
    """A main grid whose warm start scores 3 of 4 and whose base model (its "before") 1 of 4, as committed."""
    monkeypatch.setattr(g, "RESULTS", tmp_path)
    main = tmp_path / "policy_lag"
    _cell(main / "warmstart", 0.75, [1, 1, 1, 0], depth=0)  # committed whole, as in the repository
    (main / "warmstart" / "eval.json").write_text(json.dumps({"before": {"accuracy": 0.25, "scores": [1, 0, 0, 0]},
                                                              "after": {"accuracy": 0.75, "scores": [1, 1, 1, 0]}}))
    return main


def test_report_calibrates_base_16x4_and_shows_its_grid(g, rep, tmp_path, monkeypatch):
    # the base model scores 1 of 4 (the warm start's "before"); base_16x4's seeds 1-3 end at 0.75, 0.70, 0.80
    main = _main_grid(g, tmp_path, monkeypatch)
    res = tmp_path / "async_lag"
    for s, acc in ((1, 0.75), (2, 0.70), (3, 0.80)):
        _cell(res / "base_16x4" / f"trl_d0_s{s}", acc, [1, 1, 0, 0], depth=0)
    _cell(res / "base_16x4" / "trl_d2_s1", 0.50, [1, 0, 1, 0], depth=2)
    _cell(res / "base_16x4" / "trl_d2_s2", 0.60, [1, 0, 1, 0], depth=2)
    _cell(res / "base_16x4" / "bypass_d2_s1", 0.55, [1, 0, 1, 0], depth=1)  # logged lag 1: fails the d = 2 check
    v = g.verdict_of(g.candidate("base_16x4"), res, main)  # gains 0.50, 0.45, 0.55: s.e. 0.0289, 17 s.e.
    assert v.status == g.MEASURABLE and v.n == 3
    text = rep.report(res, main_grid=main)
    assert text.startswith(rep.BEGIN) and text.endswith(rep.END) and "EMULATED" in text
    assert "| base_16x4 | base | 16 x 4 | 3 | 25.0 | 75.0 | +50.0 ± 2.9 |" in text
    assert "| warm_32x8 | warmstart | 32 x 8 | 0 | 75.0 | — | — | — | run more seeds" in text
    assert "Grid in design `base_16x4` (base, 16 steps x 4 prompts; start 25.0 %)" in text
    # trl_d0 - trl_d2 by seed: 0.75 - 0.50 and 0.70 - 0.60; the failed bypass cell is committed, so not "not run"
    assert "| trl_d2 | 2 | 55.0 |" in text and "| trl_d0 - trl_d2 | 2 (1) | +17.5 [" in text
    assert "Left out (lag check failed): bypass_d2_s1 (step 3: policy lag max/mean (1, 1), expected 2; step 4" in text
    assert "Not run yet (19 of the grid's cells): tis_d2_s1, rs_engine_d2_s1, bypass_d2_s2," in text


def test_grid_finals_leaves_out_a_cell_that_did_not_start_at_the_start(g, rep, tmp_path):
    res = tmp_path / "async_lag"
    _cell(res / "base_32x8" / "trl_d2_s1", 0.50, [1, 0], depth=2, steps=32)
    _cell(res / "base_32x8" / "trl_d2_s2", 0.60, [1, 1], depth=2, steps=32)
    (res / "base_32x8" / "trl_d2_s2" / "cell_meta.json").write_text(json.dumps({"starts_at_start": False}))
    finals, failed = rep.grid_finals(g.candidate("base_32x8"), res, {0, 2})
    assert finals == {("trl", 2): {1: 0.50}}
    assert failed == ["trl_d2_s2 (its step-0 check differs from the start's scores)"]


def test_a_partly_committed_cell_fails_its_check(g, rep, tmp_path):
    """A cell folder with eval.json but no (or a short) log.jsonl, or no cell_meta.json, is a partial commit: the lag
    check has nothing to check there, so it must not pass (it did: an empty log has no violation)."""
    cand = g.candidate("base_16x4")
    res = tmp_path / "async_lag"
    _cell(res / cand.name / "trl_d2_s1", 0.50, [1, 0], depth=2)  # complete: 16 steps, meta
    _cell(res / cand.name / "trl_d2_s2", 0.90, [1, 0])  # eval.json only
    _cell(res / cand.name / "trl_d2_s3", 0.90, [1, 0], depth=2, steps=5)  # a log cut after 5 of its 16 steps
    _cell(res / cand.name / "trl_d2_s4", 0.90, [1, 0], depth=2)
    (res / cand.name / "trl_d2_s4" / "cell_meta.json").unlink()
    finals, failed = rep.grid_finals(cand, res, {2})
    assert finals == {("trl", 2): {1: 0.50}}  # not the three partial cells' 0.90
    assert g.async_lag_check([], 2, 0.03, expected_steps=16) == ["0 logged steps, expected 16"]
    assert failed == ["trl_d2_s2 (0 logged steps, expected 16; no cell_meta.json)",
                      "trl_d2_s3 (5 logged steps, expected 16)", "trl_d2_s4 (no cell_meta.json)"]
    assert not g.committed(res / cand.name / "trl_d2_s2") and g.committed(res / cand.name / "trl_d2_s1")


def test_calibration_leaves_out_the_cells_the_report_leaves_out(g, rep, tmp_path, monkeypatch):
    """An on-policy cell whose lag check fails (k3_kl 0.05 at lag 0, over the 0.03 bound) is left out of the
    calibration as the report's grid table leaves it out, and the next calibration seed is a fresh one."""
    main = _main_grid(g, tmp_path, monkeypatch)
    cand, res = g.candidate("base_16x4"), tmp_path / "async_lag"
    _cell(res / cand.name / "trl_d0_s1", 0.75, [1, 1, 0, 0], depth=0)
    _cell(res / cand.name / "trl_d0_s2", 0.70, [1, 1, 0, 0], depth=0)
    _cell(res / cand.name / "trl_d0_s3", 0.80, [1, 1, 0, 0], depth=0, kl=0.05)
    # seed 1 (+0.50) and seed 2 (+0.45); seed 3 failed its check
    assert g.on_policy_gains(cand, res, main) == pytest.approx({1: 0.50, 2: 0.45})
    v = g.verdict_of(cand, res, main)
    assert v.n == 2 and v.status == g.MORE_SEEDS
    assert g.next_calibration_seed(cand, res) == 4  # seed 3 is committed (failed): never re-run, never counted
    finals, failed = rep.grid_finals(cand, res, {0, 2})
    assert finals == {("trl", 0): {1: 0.75, 2: 0.70}}
    assert failed == ["trl_d0_s3 (lag-0 k3_kl median 0.05 over 16 lag-0 steps (later half 0.05 over 8), above the "
                      "bound 0.03)"]
    assert g.passing_accuracy(cand, "trl_d0_s3", res) is None and g.passing_accuracy(cand, "trl_d0_s2", res) == 0.70


def test_the_report_shows_the_calibration_both_ways(g, rep, tmp_path, monkeypatch):
    """A failed on-policy cell is left out of the calibration table but listed with its accuracy and reason, and the
    gain is shown with it counted (leaving out a seed that failed can select the seeds that learned)."""
    main = _main_grid(g, tmp_path, monkeypatch)
    cand, res = g.candidate("base_16x4"), tmp_path / "async_lag"
    _cell(res / cand.name / "trl_d0_s1", 0.45, [1, 1, 0, 0], depth=0)
    _cell(res / cand.name / "trl_d0_s2", 0.55, [1, 1, 0, 0], depth=0)
    _cell(res / cand.name / "trl_d0_s3", 0.15, [1, 0, 0, 0], depth=0, kl=0.05)
    assert rep.calibration_left_out(res, main_grid=main) == [
        # gains 0.20, 0.30, -0.10: mean 0.1333, sd 0.2082, s.e. 0.1202, t(2) 4.303: +-51.7; (3 sd / mean)^2 = 22
        "* base_16x4: left out of the table above: `trl_d0_s3` 15.0 % (lag-0 k3_kl median 0.05 over 16 lag-0 steps "
        "(later half 0.05 over 8), above the bound 0.03). Counted, the gain over 3 seeds is +13.3 [-38.4, +65.0] "
        "points (95 % CI; s.e. 12.0): not measurable (mean +13.3 < 3 x s.e. 12.0 points; 22 seeds needed, over the "
        "8 allowed)."]
    assert rep.calibration_left_out(res / "none", main_grid=main) == []


def test_a_design_calibrates_only_when_it_does_with_its_failed_seeds_counted(g, tmp_path, monkeypatch):
    """Seeds 1, 2, 4 pass their check and meet the rule (gains 0.20, 0.25, 0.30: 8.7 s.e.); seed 3 failed its check
    (lag-0 k3_kl 0.05) at gain -0.10. Counted: mean 0.1625, sd 0.1797, s.e. 0.0899 (1.8 s.e.), (3 sd / mean)^2 = 11.0
    -> 12 seeds, over base_16x4's 8: not measurable, so the design does not calibrate (it would by leaving out the
    seed that did not learn)."""
    main = _main_grid(g, tmp_path, monkeypatch)
    cand, res = g.candidate("base_16x4"), tmp_path / "async_lag"
    for seed, acc in ((1, 0.45), (2, 0.50), (4, 0.55)):
        _cell(res / cand.name / f"trl_d0_s{seed}", acc, [1, 1, 0, 0], depth=0)
    assert g.verdict_of(cand, res, main).status == g.MEASURABLE  # no failed cell yet
    _cell(res / cand.name / "trl_d0_s3", 0.15, [1, 0, 0, 0], depth=0, kl=0.05)
    v = g.verdict_of(cand, res, main)
    assert v.status == g.NOT_MEASURABLE and v.n == 4 and v.mean == pytest.approx(0.1625)
    assert v.seeds_needed == 12
    assert v.reason.endswith("with the 1 seed(s) that failed their check counted (left out: measurable, mean +25.0 "
                             ">= 3 x s.e. 2.9 points)")


def test_the_report_lists_the_lag0_steps_above_the_bound(g, rep, tmp_path, monkeypatch):
    """Steps above the bound in a passing cell are listed (informational) with the median the check bounds; a cell
    whose median is above says it fails; cells without such a step are not listed."""
    main = _main_grid(g, tmp_path, monkeypatch)
    cand, res = g.candidate("base_16x4"), tmp_path / "async_lag"
    spiky = [0.002] * 12 + [0.032, 0.042, 0.05, 0.062]  # median 0.002: passes
    _cell(res / cand.name / "trl_d0_s1", 0.45, [1, 1, 0, 0], depth=0, kl=spiky)
    _cell(res / cand.name / "trl_d0_s2", 0.55, [1, 1, 0, 0], depth=0)  # k3 0.001 everywhere: not listed
    _cell(res / cand.name / "trl_d0_s3", 0.15, [1, 0, 0, 0], depth=0, kl=[0.002] * 7 + [0.04] * 9)  # median 0.04
    _cell(res / cand.name / "trl_d2_s1", 0.40, [1, 0, 0, 0], depth=2, kl=[0.031] + [0.5] * 15)  # lag 0 at step 1
    assert rep.k3_above_lines(res) == [
        "* `base_16x4/trl_d0_s1`: step 13 0.032, step 14 0.042, step 15 0.050, step 16 0.062 (median over its 16 "
        "lag-0 steps 0.002)",
        "* `base_16x4/trl_d0_s3`: step 8 0.040, step 9 0.040, step 10 0.040, step 11 0.040, step 12 0.040, step 13 "
        "0.040, step 14 0.040, step 15 0.040, step 16 0.040 (median over its 16 lag-0 steps 0.040; above the bound: "
        "the cell fails its check)",
        "* `base_16x4/trl_d2_s1`: step 1 0.031 (median over its 1 lag-0 steps 0.031; above the bound: the cell fails "
        "its check)"]
    assert g.cell_problems(cand, "trl_d0_s1", res) == [] and g.cell_problems(cand, "trl_d0_s3", res) != []
    text = rep.report(res, main_grid=main)
    assert "Lag-0 steps above the k3_kl bound 0.03 (informational, not a failure" in text
    assert "* `base_16x4/trl_d0_s1`: step 13 0.032," in text
    assert "k3_kl bound" not in rep.report(tmp_path / "none", main_grid=main)


def test_named_cells_take_the_designs_calibration_grid_and_followup_cells(g):
    cand, names = g.named_cells(["trl_d0_s2", "bypass_d2_s1", "trl_d1_s3"], "base_32x8")
    assert cand.name == "base_32x8" and cand.steps == 32 and cand.prompts == 8
    assert names == ["trl_d0_s2", "bypass_d2_s1", "trl_d1_s3"]
    with pytest.raises(ValueError, match="--cells needs --candidate"):
        g.named_cells(["trl_d0_s2"], None)
    for bad in ("bypass_d0_s1", "tis_d1_s1", "trl_d3_s1"):  # bypass on-policy, tis off the follow-up, depth 3
        with pytest.raises(ValueError, match="is none of trl_d0_s<seed>"):
            g.named_cells([bad], "base_32x8")


def test_two_runners_of_a_warm_design_build_the_warm_start_once(g, tmp_path, monkeypatch):
    """``--cells`` runs side by side: two runners of a warm-start design, the warm start not built yet. The second
    must wait for the first's build and use it, not build it again into the same folder at the same time."""
    import argparse
    import threading
    import time
    import types

    builds, inside = [], []

    def build(name, args):
        inside.append(name)
        assert len(inside) == 1, "two warm-start builds at once"
        time.sleep(0.5)
        (tmp_path / "main" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "main" / name / "model.safetensors").write_text("w")
        builds.append(args.out)
        inside.pop()

    monkeypatch.setattr(g.pl, "run_cell", build)
    monkeypatch.setattr(g, "subprocess", types.SimpleNamespace(
        STDOUT=-2, run=lambda *a, **k: types.SimpleNamespace(returncode=1)))
    args = argparse.Namespace(results=str(tmp_path / "results"), main_out=str(tmp_path / "main"),
                              out=str(tmp_path / "out"), lr=3e-5, check_every=8, check_size=128, eval_size=512,
                              eval_max_tokens=32, cpu_kernels="native", engine_kl_max=0.03)
    cand = g.candidate("warm_32x16")
    errors = []

    def runner(name):
        try:
            assert g.run_cell(cand, name, args) is False  # the cell process itself "failed" (rc 1)
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=runner, args=(f"trl_d0_s{s}",)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and builds == [str(tmp_path / "main")]


def test_two_cells_runners_with_one_list_share_it_as_a_queue(g, tmp_path, monkeypatch):
    """Two ``--cells`` runners given the same list: a cell the other runner holds is skipped, never run twice; a
    runner that waited for the claim finds the cell committed and does not run it again."""
    import argparse

    ran = []

    def fake_run(cand, name, args, results):
        ran.append(name)
        results.mkdir(parents=True, exist_ok=True)
        for f in g.COMMITTED_FILES:
            (results / f).write_text("{}")
        return True

    monkeypatch.setattr(g, "_run_claimed", fake_run)
    args = argparse.Namespace(results=str(tmp_path / "results"), out=str(tmp_path / "out"), commit=False)
    cand = g.candidate("base_32x8")
    held = tmp_path / "out" / "base_32x8" / "tis_d2_s1.claim"
    with g.pl.file_lock(held, wait=False) as mine:  # "runner A" holds tis_d2_s1
        assert mine is True
        with g.pl.file_lock(held, wait=False) as theirs:
            assert theirs is False  # a second lock on the same file, not waited for
        assert g.run_cell(cand, "tis_d2_s1", args, wait=False) is True
        assert g.run_cell(cand, "rs_engine_d2_s1", args, wait=False) is True
        assert ran == ["rs_engine_d2_s1"]  # the held cell was skipped, the free one ran
        fake_run(cand, "tis_d2_s1", args, g.cell_folder(cand, "tis_d2_s1", tmp_path / "results"))
    ran.clear()
    for name in ("tis_d2_s1", "rs_engine_d2_s1"):  # both committed now: neither runs again, waiting or not
        assert g.run_cell(cand, name, args, wait=True) is True
    assert ran == []
    with g.pl.file_lock(held, wait=False) as again:  # released with its runner
        assert again is True


def test_a_complete_cell_left_uncommitted_is_committed_on_resume(g, tmp_path):
    """``--commit``: a cell whose files were copied but whose commit never ran is committed by the next runner
    instead of being skipped as done; a committed cell is left alone (no empty commit)."""
    import argparse
    import subprocess

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    git("commit", "-q", "--allow-empty", "-m", "root")
    cand = g.candidate("base_32x8")
    args = argparse.Namespace(results=str(tmp_path / "results"), out=str(tmp_path / "out"), commit=True)
    folder = g.cell_folder(cand, "trl_d2_s3", tmp_path / "results")
    folder.mkdir(parents=True)
    for f in g.COMMITTED_FILES:
        (folder / f).write_text("{}")
    assert g.run_cell(cand, "trl_d2_s3", args, wait=False) is True
    assert git("status", "--porcelain").strip() == ""
    log = git("log", "--format=%s").splitlines()
    assert log[0].startswith("results: base_32x8/trl_d2_s3 (complete on disk but not committed") and len(log) == 2
    assert g.run_cell(cand, "trl_d2_s3", args, wait=False) is True
    assert len(git("log", "--format=%s").splitlines()) == 2  # nothing to commit: no second commit


def test_cell_meta_records_the_commit_the_cell_started_at(g, tmp_path, monkeypatch):
    """A merge into the experiment clone while a cell runs moves HEAD: ``cell_meta.json``'s ``code`` must be the
    commit the cell process started at, not the one HEAD points to when it ends."""
    import argparse
    import types

    revisions = iter(["started-at", "merged-mid-cell"])
    monkeypatch.setattr(g.pl, "code_revision", lambda: next(revisions))
    monkeypatch.setattr(g, "start_scores", lambda cand: [1, 0, 0, 0])

    def fake_run(cmd, stdout, **kw):  # the cell process: its outputs as run_cell_in_process leaves them
        out = tmp_path / "out" / "base_32x8" / "trl_d2_s3"
        log = [{"step": t, "loss": 0.0, "step_time": 1.0, "rollout_corr/policy_lag_max": min(t - 1, 2),
                "rollout_corr/policy_lag_mean": min(t - 1, 2), "rollout_corr/k3_kl": 0.001} for t in range(1, 33)]
        (out / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log) + "\n")
        (out / "curve.jsonl").write_text(json.dumps({"step": 0, "scores": [1, 0, 0, 0]}) + "\n")
        (out / "eval.json").write_text(json.dumps({"after": {"correct": 2, "total": 4, "accuracy": 0.5}}))
        stdout.write("done\n")
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(g, "subprocess", types.SimpleNamespace(STDOUT=-2, run=fake_run))
    args = argparse.Namespace(results=str(tmp_path / "results"), out=str(tmp_path / "out"), commit=False, lr=3e-5,
                              check_every=8, check_size=128, eval_size=512, eval_max_tokens=32, cpu_kernels="native",
                              engine_kl_max=0.03, main_out=str(tmp_path / "main"))
    cand = g.candidate("base_32x8")
    assert g.run_cell(cand, "trl_d2_s3", args, wait=False) is True
    meta = json.loads((tmp_path / "results" / "base_32x8" / "trl_d2_s3" / "cell_meta.json").read_text())
    assert meta["code"] == "started-at" and meta["lag_check"] == "passed" and meta["starts_at_start"] is True


def test_only_a_warm_start_design_is_held_to_the_main_grids_vendor(g, tmp_path):
    grid = tmp_path / "policy_lag"
    (grid / "tis_k1_s1").mkdir(parents=True)
    (grid / "tis_k1_s1" / "cell_meta.json").write_text(json.dumps({"cpu": {"model": "AMD EPYC"}}))
    g.check_start_vendor(g.candidate("base_32x8"), grid, here="Intel")  # the base model: any vendor
    g.check_start_vendor(g.candidate("warm_32x8"), grid, here="AMD")
    with pytest.raises(RuntimeError, match="run on AMD CPUs and this machine's is Intel"):
        g.check_start_vendor(g.candidate("warm_32x8"), grid, here="Intel")  # a rebuilt warm start differs


def test_a_seed_whose_two_cells_ran_on_two_vendors_is_not_paired(g, rep, tmp_path):
    # FINALS with seed 3's trl_d2 cell on Intel and every other cell on AMD: bypass - trl at d = 2 pairs seeds 1 and
    # 2 only: +0.08, +0.01: mean 0.045, sd 0.049497, s.e. 0.035, t(0.975, 1) = 12.7062: half 0.4447 -> [-40.0, +49.0]
    vendors = {arm: {s: "AMD" for s in by_seed} for arm, by_seed in FINALS.items()}
    vendors[("trl", 2)][3] = "Intel"
    rows = rep.pair_rows(FINALS, 2, vendors)
    assert rows[2].startswith("| bypass_d2 - trl_d2 | 2 (1) | +4.5 [-40.0, +49.0], p ")
    assert rows[2].endswith("| 2/2 | not established; 1 across vendors left out (seed 3) |")
    assert rows[3].startswith("| trl_d0 - trl_d2 | 2 (1) | +9.0 [")  # +0.10, +0.08
    assert rep.paired(FINALS[("bypass", 2)], FINALS[("trl", 2)]) == pytest.approx([0.08, 0.01, 0.12])  # no vendors
    arms = rep.arm_rows(FINALS, 0.20, vendors=vendors)
    assert arms[4].endswith("| -9.0 [-21.7, +3.7] (2; not established); 1 across vendors left out |")
    assert rep.vendor_line(vendors) == (
        "AMD: seeds 1, 2, 3; Intel: seed 3 (seed 3: trl_d0, bypass_d2 on AMD; trl_d2 on Intel)")
    # an arm with no seed paired says why: its only seed ran on the other vendor
    lone = rep.arm_rows({("trl", 0): {1: 0.4}, ("tis", 2): {1: 0.3}}, 0.2,
                        vendors={("trl", 0): {1: "AMD"}, ("tis", 2): {1: "Intel"}})
    assert lone[3].endswith("| no paired seed yet (1 across vendors left out) |")
    # grid_vendors reads each cell's cell_meta.json "cpu" (vendor_id first, then the model name; None without it)
    res = tmp_path / "async_lag"
    cand = g.candidate("base_32x8")
    for name, cpu in (("trl_d2_s1", {"model": "AMD EPYC", "vendor_id": "AuthenticAMD"}),
                      ("trl_d2_s2", {"model": "Intel(R) Xeon(R) Processor"}), ("bypass_d2_s1", None)):
        (res / cand.name / name).mkdir(parents=True)
        (res / cand.name / name / "cell_meta.json").write_text(json.dumps({"cpu": cpu} if cpu else {}))
    got = rep.grid_vendors(cand, res, {("trl", 2): {1: 0.3, 2: 0.4}, ("bypass", 2): {1: 0.5}})
    assert got == {("trl", 2): {1: "AMD", 2: "Intel"}, ("bypass", 2): {1: None}}


def test_one_vendors_grid_is_its_cells_only(rep):
    vendors = {arm: {s: "AMD" for s in by_seed} for arm, by_seed in FINALS.items()}
    vendors[("trl", 2)][3] = "Intel"
    vendors[("bypass", 2)][3] = "Intel"
    amd = rep.one_vendor(FINALS, vendors, "AMD")
    assert amd == {("trl", 0): {1: 0.40, 2: 0.44, 3: 0.42}, ("trl", 2): {1: 0.30, 2: 0.36},
                   ("bypass", 2): {1: 0.38, 2: 0.37}}
    assert rep.one_vendor(FINALS, vendors, "Intel") == {("trl", 2): {3: 0.33}, ("bypass", 2): {3: 0.45}}
    # seed 3's bypass and trl cells ran on one vendor (Intel): paired in the pooled table, 3 seeds as without vendors
    assert rep.pair_rows(FINALS, 2, vendors)[2] == rep.pair_rows(FINALS, 2)[2]
    assert rep.pair_rows(rep.one_vendor(FINALS, vendors, "Intel"), 2)[2] == (
        "| bypass_d2 - trl_d2 | 1 (0) | +12.0 (n = 1: no interval) | 1/1 | n = 1: no interval |")


def test_start_check_compares_this_vendors_start_item_by_item(g, rep, tmp_path, monkeypatch):
    """``--start-check`` runs the evaluation in a cell's environment (a subprocess, faked here: it writes scores
    that differ from the committed start's at items 1 and 3), records which items differ and writes
    start_<vendor>.json; the report quotes it. A warm-start design is refused."""
    cand = g.candidate("base_32x8")
    monkeypatch.setattr(g, "start_scores", lambda c, main_grid=None: [1, 0, 0, 1])
    monkeypatch.setattr(g.pl, "cpu_fingerprint", lambda: {"model": "Intel(R) Xeon(R)", "vendor_id": "GenuineIntel"})
    seen, real_run = {}, subprocess.run

    def fake_run(cmd, **kw):
        if "--run-start-check" not in cmd:
            return real_run(cmd, **kw)  # git (code_revision)
        seen["cmd"], seen["env"] = cmd, kw["env"]
        out = cmd[cmd.index("--run-start-check") + 1]
        Path(out).write_text(json.dumps({"correct": 3, "total": 4, "scores": [1, 1, 0, 0], "seconds": 1.0}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(g.subprocess, "run", fake_run)
    args = argparse.Namespace(out=str(tmp_path / "out"), results=str(tmp_path / "res"), eval_size=4,
                              eval_max_tokens=32, cpu_kernels="avx2", lr=3e-5, main_out=str(tmp_path / "main"),
                              commit=False)
    rec = g.start_check(cand, args)
    assert rec["vendor"] == "Intel" and rec["differ_at"] == [1, 3] and not rec["same_as_start"]
    assert seen["env"]["OMP_NUM_THREADS"] == "1" and str(g.pl.AVX2_KERNELS) in seen["env"]["PYTHONPATH"]
    assert seen["cmd"][seen["cmd"].index("--run-start-check") + 2] == "4"  # the eval size
    path = g.start_check_path(cand, "Intel", tmp_path / "res")
    assert json.loads(path.read_text())["scores"] == [1, 1, 0, 0]
    assert rep.start_check_lines(cand, tmp_path / "res") == [
        "* The start evaluated on Intel (`--start-check`, Intel(R) Xeon(R), 4 items at 32 tokens): 3/4, 2 items "
        "scored otherwise than in the committed start's."]
    with pytest.raises(ValueError, match="starts from the warm start"):
        g.start_check(g.candidate("warm_32x8"), args)
    # a shorter evaluation would compare only the first items: refused, naming the settings to use
    with pytest.raises(ValueError, match="run it with --eval-size 4 --eval-max-tokens 32, not 3 / 32"):
        g.start_check(cand, argparse.Namespace(**{**vars(args), "eval_size": 3}))
    assert json.loads(path.read_text())["max_tokens"] == 32


def test_the_phased_driver_pairs_the_lag_effect_within_a_vendor_and_reused_cells_take_their_grids(g, tmp_path,
                                                                                                  monkeypatch):
    # trl_d0 - trl_d2: seeds 1-3 +0.10, +0.08, +0.09 (established, as in FINALS); seed 3's trl_d2 on Intel leaves
    # +0.10, +0.08: t(0.975, 1) x 0.01 = 0.127 > 0.09, not established
    d2, d0 = FINALS[("trl", 2)], FINALS[("trl", 0)]
    assert g.lag_effect_established(d2, d0)
    amd = {1: "AMD", 2: "AMD", 3: "AMD"}
    assert g.lag_effect_established(d2, d0, (amd, amd))
    assert not g.lag_effect_established(d2, d0, ({**amd, 3: "Intel"}, amd))
    # a reused cell (warm_32x8's trl_d0_s1 is policy_lag/trl_k1_s1) that records no CPU takes its grid's vendor
    monkeypatch.setattr(g, "RESULTS", tmp_path)
    for name, meta in (("trl_k1_s1", {}), ("tis_k1_s1", {"cpu": {"model": "AMD EPYC"}})):
        (tmp_path / "policy_lag" / name).mkdir(parents=True)
        (tmp_path / "policy_lag" / name / "cell_meta.json").write_text(json.dumps(meta))
    res = tmp_path / "async_lag"
    assert g.cell_vendor(g.candidate("warm_32x8"), "trl_d0_s1", res) == "AMD"
    (res / "warm_32x8" / "trl_d2_s1").mkdir(parents=True)  # our own cell with no CPU recorded: None, no fallback
    (res / "warm_32x8" / "trl_d2_s1" / "cell_meta.json").write_text(json.dumps({"cpu": None}))
    assert g.cell_vendor(g.candidate("warm_32x8"), "trl_d2_s1", res) is None


def test_a_machine_of_unknown_vendor_runs_no_cell(g, tmp_path):
    with pytest.raises(RuntimeError, match="CPU vendor is unknown"):
        g.check_start_vendor(g.candidate("base_32x8"), tmp_path / "policy_lag", here="")


def test_a_verdict_before_the_planned_seeds_is_marked_interim(rep):
    # FINALS at 3 paired seeds of 5 planned: trl_d0 - trl_d2 is established (+9.0 [+6.5, +11.5]) but only interim
    rows = rep.pair_rows(FINALS, 2, planned=5)
    assert rows[3] == ("| trl_d0 - trl_d2 | 3 (2) | +9.0 [+6.5, +11.5], p 0.0041 | 3/3 | established (interim: 3 of 5 "
                       "planned seeds) |")
    assert rep.pair_rows(FINALS, 2, planned=3)[3].endswith("| 3/3 | established |")  # the planned end: final
