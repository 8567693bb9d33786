"""benchmarks/async_lag_grid.py and async_lag_report.py (issue 47, the emulated d = 2 grid): the calibration's
decision rule, the cells' names, flags and lag check, and the report's rows, on hand-computed values."""

import json
import math

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
    assert g.async_lag_check(bad, 2, 0.03) == ["step 1: lag 0 but k3_kl 0.04 (bound 0.03)",
                                               "step 4: policy lag max/mean (2.0, 1.5), expected 2"]
    assert g.async_lag_check(good, 0, 0.03)[0] == "step 2: policy lag max/mean (1.0, 1.0), expected 0"


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
    ``kl``) and cell_meta.json, as ``run_cell`` commits them."""
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps({"after": {"accuracy": acc, "scores": scores}}))
    if depth is not None:
        log = [{"step": t, "loss": 0.0, "step_time": 1.0, "rollout_corr/policy_lag_max": min(t - 1, depth),
                "rollout_corr/policy_lag_mean": min(t - 1, depth), "rollout_corr/k3_kl": kl}
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
    assert finals == {("trl", 0): {1: 0.75, 2: 0.70}} and failed[0].startswith("trl_d0_s3 (step 1: lag 0 but k3_kl")
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
        "* base_16x4: left out of the table above: `trl_d0_s3` 15.0 % (step 1: lag 0 but k3_kl 0.05 (bound 0.03) and "
        "15 more). Counted, the gain over 3 seeds is +13.3 [-38.4, +65.0] points (95 % CI; s.e. 12.0): not "
        "measurable (mean +13.3 < 3 x s.e. 12.0 points; 22 seeds needed, over the 8 allowed)."]
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
