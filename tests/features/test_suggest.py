"""``trl-rollout-corr analyze DUMP --suggest``: the threshold rule by hand, the suggestion re-applied with
``analyze --config`` keeps the requested fraction to within one token (one row) on a tiny-model dump with a real
engine mismatch (bf16 generation, float32 training), the lag-0 quantile, and bad input."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch

from hand_dump import hand_dump, random_dump
from trl_rollout_corr.cli import EXIT_BAD_INPUT, EXIT_OK, main
from trl_rollout_corr.correction.rejection import RS_OPTIONS
from trl_rollout_corr.suggest import pick_threshold


@pytest.mark.unit
def test_threshold_rule_by_hand():
    values = torch.tensor([0.4, 0.1, 0.3, 0.2], dtype=torch.float64)
    assert pick_threshold(values, 0.5, log_space=False) == (0.2, "")  # k = 2: the 2nd smallest
    assert pick_threshold(values, 0.51, log_space=False)[0] == 0.3  # k = ceil(2.04) = 3
    assert pick_threshold(values, 1.0, log_space=False)[0] == 0.4
    t, _ = pick_threshold(values, 0.5, log_space=True)  # half-way between 0.2 and 0.3, as a ratio
    assert t == pytest.approx(math.exp(0.25))
    t, note = pick_threshold(torch.tensor([0.0, 0.0, 0.0, 0.5]), 0.5, log_space=False)
    assert t == 0.5 and "smallest positive" in note
    assert "ties" in pick_threshold(torch.tensor([0.1, 0.2, 0.2, 0.3]), 0.5, log_space=False)[1]


@pytest.fixture(scope="module")
def mismatch_dump(llama_dir, tmp_path_factory):
    """A 4-step decoupled run (token TIS + seq_mean_k3) sampling in bf16 and training in float32, with
    steps_per_generation=2 so that half the uses are at policy lag 1."""
    from conftest import _make_trainer

    tmp = tmp_path_factory.mktemp("suggest")
    trainer = _make_trainer(llama_dir, tmp, max_steps=4, rollout_corr_preset="decoupled_k3_rs_token_tis",
                            rollout_generate_dtype="bfloat16", max_completion_length=16, steps_per_generation=2,
                            rollout_dump_dir=str(tmp / "dump"))
    trainer.train()
    return tmp / "dump"


def _reapplied(dump, yaml_path, out):
    """``analyze DUMP --config YAML``: the what-if's total summary from analysis.json."""
    assert main(["analyze", str(dump), "--config", str(yaml_path), "--out", str(out), "--no-plots"]) == EXIT_OK
    report = json.loads((out / "analysis.json").read_text())
    return report["configs"][1]


def test_suggested_threshold_keeps_the_fraction_when_reapplied(mismatch_dump, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["analyze", str(mismatch_dump), "--suggest", "--keep", "0.9", "--out", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "rollout_rs: token_k3" in text and "By policy lag" in text and "By response length" in text
    assert (out / "suggest_kept_vs_threshold.png").stat().st_size > 10_000
    report = {s["option"]: s for s in json.loads((out / "suggest.json").read_text())["suggestions"]}
    assert set(report) >= {"token_k1", "token_k3", "token_binary_kl", "seq_mean_k3", "is_token", "is_sequence"}
    checked = 0
    for option in ("token_k1", "token_k2", "token_k3", "token_binary_kl"):
        s = report[option]
        again = _reapplied(mismatch_dump, out / "suggest_configs" / f"{option}.yaml", tmp_path / option)
        n = again["total"]["valid_tokens"]
        kept = again["total"]["kept_tokens"] * n
        assert kept == pytest.approx(s["kept"] * n, abs=1e-6)  # the suggestion's own report is the re-application
        if not s["note"]:  # without ties at the threshold: within one token of the request
            assert abs(kept - 0.9 * n) <= 1.0, (option, kept, 0.9 * n)
            checked += 1
    assert checked >= 2
    s = report["seq_mean_k3"]
    again = _reapplied(mismatch_dump, out / "suggest_configs" / "seq_mean_k3.yaml", tmp_path / "seq")
    rows = again["total"]["valid_rows"]
    assert abs(again["total"]["kept_rows"] * rows - 0.9 * rows) <= 1.0
    # the RS suggestion keeps the trained IS (token TIS 2.0): its ESS is reported
    assert report["token_k3"]["config"]["rollout_is"] == "token" and report["token_k3"]["total"]["ess"] > 0.5
    # IS: the untruncated fraction of the token weights
    assert abs(report["is_token"]["kept"] * report["is_token"]["population"]
               - 0.9 * report["is_token"]["population"]) <= 1.0


def test_lag0_quantile(mismatch_dump, tmp_path):
    out = tmp_path / "q"
    argv = ["analyze", str(mismatch_dump), "--suggest", "--quantile", "0.8", "--suggest-options", "token_k3",
            "--out", str(out), "--no-plots"]
    assert main(argv) == EXIT_OK
    (s,) = json.loads((out / "suggest.json").read_text())["suggestions"]
    assert set(s["by_lag"]) == {"0", "1"}
    lag0 = s["by_lag"]["0"]
    assert s["population"] == lag0["valid_tokens"] < s["total"]["valid_tokens"]  # read from the lag-0 uses only
    assert abs(lag0["kept_tokens"] * lag0["valid_tokens"] - 0.8 * lag0["valid_tokens"]) <= 1.0


@pytest.mark.unit
def test_bad_input(tmp_path, capsys):
    dump = hand_dump(tmp_path / "d")
    step_file = next(dump.glob("**/*.parquet"))
    table = pq.read_table(step_file)
    pq.write_table(table.drop_columns(["old_log_probs", "log_probs"]).replace_schema_metadata(table.schema.metadata),
                   step_file)
    assert main(["analyze", str(dump), "--suggest", "--keep", "0.9", "--no-plots"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--suggest needs the trainer's log-probs" in err and "'old_log_probs'" in err
    assert "Re-run the training" in err
    assert not (dump / "analysis").exists()
    good = hand_dump(tmp_path / "g")
    for argv, message in [
        (["--suggest", "--keep", "1.5"], "--keep 1.5: expected a fraction in (0, 1]"),
        (["--suggest"], "needs exactly one of --keep F"),
        (["--suggest", "--keep", "0.9", "--quantile", "0.9"], "needs exactly one of --keep F"),
        (["--keep", "0.9"], "belong to --suggest"),
        (["--suggest", "--keep", "0.9", "--suggest-options", "token_k4"], "unknown option 'token_k4'"),
        (["--suggest", "--keep", "0.9", "--preset", "decoupled_geo_rs"], "drop --preset / --config"),
    ]:
        assert main(["analyze", str(good), *argv, "--no-plots"]) == EXIT_BAD_INPUT, argv
        assert message in capsys.readouterr().err, argv


def _kept_count(option: str, config_report: dict) -> tuple[float, float]:
    """(kept, population) counts of one re-applied config (``analysis.json``'s entry): tokens or rows in the RS mask,
    or for an IS cap the untruncated weights (per step: (1 - fraction_high) x the valid tokens / rows)."""
    if option.startswith("is_"):
        unit = "num_valid_tokens" if option == "is_token" else "num_valid_seqs"
        steps = [s["metrics"] for s in config_report["per_step"].values()]
        population = sum(m[f"rollout_corr/{unit}"] for m in steps)
        return sum((1 - m["rollout_corr/rollout_is_ratio_fraction_high"]) * m[f"rollout_corr/{unit}"]
                   for m in steps), population
    total = config_report["total"]
    unit = "tokens" if option.startswith("token_") else "rows"
    return total[f"kept_{unit}"] * total[f"valid_{unit}"], total[f"valid_{unit}"]


@pytest.mark.unit
def test_every_reapplied_suggestion_keeps_the_fraction_within_one(tmp_path):
    """A random dump (continuous statistics: no ties): for every RS option and both IS caps, the threshold
    ``--suggest --keep 0.9`` writes, re-applied with ``analyze --config``, keeps 90% of the option's population to
    within one token (token options, is_token) or one row (sequence options, is_sequence)."""
    dump = random_dump(tmp_path / "d")
    out = tmp_path / "s"
    assert main(["analyze", str(dump), "--suggest", "--keep", "0.9", "--out", str(out), "--no-plots"]) == EXIT_OK
    report = {s["option"]: s for s in json.loads((out / "suggest.json").read_text())["suggestions"]}
    assert set(report) == {*RS_OPTIONS, "is_token", "is_sequence"}
    for option, s in report.items():
        assert not s["note"], option
        again = _reapplied(dump, out / "suggest_configs" / f"{option}.yaml", tmp_path / option)
        kept, population = _kept_count(option, again)
        assert population == s["population"] > 40, option
        assert kept == pytest.approx(s["kept"] * population, abs=1e-6), option  # the suggestion's own report
        assert abs(kept - 0.9 * population) <= 1.0, (option, kept, 0.9 * population)


@pytest.mark.unit
def test_rows_over_max_policy_lag_are_not_in_the_population(tmp_path):
    """12 of 48 rows at lag 2 with max_policy_lag 1 (the trainer dropped them from the correction): the suggestion's
    population is the other 36 rows' tokens, so its re-application keeps 90% of them to within one token (before
    the fix the dropped rows' tokens were counted and the kept fraction of the trained tokens was off)."""
    dump = random_dump(tmp_path / "d", stale_rows=12)
    out = tmp_path / "s"
    argv = ["analyze", str(dump), "--suggest", "--keep", "0.9", "--suggest-options", "token_k3,seq_mean_k3,is_token",
            "--out", str(out), "--no-plots"]
    assert main(argv) == EXIT_OK
    report = {s["option"]: s for s in json.loads((out / "suggest.json").read_text())["suggestions"]}
    table = pq.read_table(next(dump.glob("**/*.parquet")))
    lengths = [sum(m) for m in table.column("completion_mask").to_pylist()]
    assert table.column("policy_version").to_pylist()[:13] == [0] * 12 + [2]
    for option, s in report.items():
        again = _reapplied(dump, out / "suggest_configs" / f"{option}.yaml", tmp_path / option)
        kept, population = _kept_count(option, again)
        assert population == s["population"] == (36 if option.startswith("seq_") else sum(lengths[12:])), option
        assert abs(kept - 0.9 * population) <= 1.0, (option, kept, 0.9 * population)


# ---------------------------------------------------------------------------------------------- the engine factor
@pytest.mark.unit
def test_engine_factor_thresholds_by_hand_and_reapplied(tmp_path, capsys):
    """``hand_dump.lag_dump``: 8 valid tokens in 3 rows within max_policy_lag (row 3, lag 2, left out), engine factor
    |e| = [0.1, 0.2, 0.3], [0.4, 0.5] at lag 0 and [0.05, 0.15, 0.25] at lag 1, whose whole ratio is 1 nat larger
    (|l| = 1.05, 1.15, 1.25). --keep 0.6: k = ceil(4.8) = 5 tokens, ceil(1.8) = 2 rows.

    * token_k1 (half-way in log space): engine (0.25 + 0.3) / 2 -> e^0.275; whole ratio (0.5 + 1.05) / 2 -> e^0.775;
    * token_k2 (the 5th smallest x^2 / 2): engine 0.25^2 / 2 = 0.03125; whole ratio 0.5^2 / 2 = 0.125;
    * seq_mean_k1 (row means 0.2, 0.45 and 0.15 engine, 1.15 whole): e^((0.2 + 0.45) / 2) vs e^((0.45 + 1.15) / 2).

    Both keep 5 of 8 tokens, but not the same ones: on the engine factor all 3 stale tokens and 2 of the 5 fresh ones,
    on the whole ratio the 5 fresh ones only. Each engine YAML re-applied with analyze --config (rollout_rs_on:
    engine) keeps exactly that."""
    from hand_dump import lag_dump

    dump = lag_dump(tmp_path / "d")
    out = tmp_path / "s"
    argv = ["analyze", str(dump), "--suggest", "--keep", "0.6", "--suggest-options",
            "token_k1,token_k2,seq_mean_k1,is_token", "--out", str(out), "--no-plots"]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    assert "RS on the engine factor pi_train@v / mu" in text and "token_k1_engine" in text
    report = json.loads((out / "suggest.json").read_text())
    assert report["engine_left_out"] is None
    direct = {s["option"]: s for s in report["suggestions"]}
    engine = {s["name"]: s for s in report["engine_suggestions"]}
    assert list(direct) == ["token_k1", "token_k2", "seq_mean_k1", "is_token"]
    assert list(engine) == ["token_k1_engine", "token_k2_engine", "seq_mean_k1_engine"]  # no IS cap: IS is whole
    hand = {"token_k1": (math.exp(0.275), math.exp(0.775)), "token_k2": (0.03125, 0.125),
            "seq_mean_k1": (math.exp(0.325), math.exp(0.8))}
    for option, (on_engine, whole) in hand.items():
        e, d = engine[option + "_engine"], direct[option]
        assert e["threshold"] == pytest.approx(on_engine, rel=1e-6), option  # float32 log-probs in the records
        assert d["threshold"] == pytest.approx(whole, rel=1e-6), option
        assert e["rs_on"] == "engine" and e["config"]["rollout_rs_on"] == "engine" and e["option"] == option
        assert d["config"]["rollout_rs_on"] == "direct"
        assert e["population"] == d["population"] == (3 if option.startswith("seq_") else 8), option
        yaml_text = (out / "suggest_configs" / f"{option}_engine.yaml").read_text()
        assert "rollout_rs_on: engine" in yaml_text and "policy_lag_split: true" in yaml_text
        assert "rollout_rs_on: direct" in (out / "suggest_configs" / f"{option}.yaml").read_text()
        again = _reapplied(dump, out / "suggest_configs" / f"{option}_engine.yaml", tmp_path / option)
        assert again["config"]["rollout_rs_on"] == "engine"
        kept, population = _kept_count(option, again)
        assert kept == pytest.approx(e["kept"] * population, abs=1e-6), option
        assert abs(kept - 0.6 * population) <= 1.0, (option, kept)
    for option in ("token_k1", "token_k2"):  # the stale tokens: kept on the engine factor, rejected on the whole
        e, d = engine[option + "_engine"], direct[option]
        assert e["total"]["kept_tokens"] == d["total"]["kept_tokens"] == 5 / 8
        assert (e["by_lag"]["0"]["kept_tokens"], e["by_lag"]["1"]["kept_tokens"]) == (pytest.approx(2 / 5), 1.0)
        assert (d["by_lag"]["0"]["kept_tokens"], d["by_lag"]["1"]["kept_tokens"]) == (1.0, 0.0)


@pytest.mark.unit
def test_engine_factor_lag0_quantile(tmp_path):
    """--quantile reads the lag-0 uses, where the engine factor is the whole ratio: the same threshold (token_k2 at
    the 0.6 quantile of the 5 lag-0 tokens: the 3rd smallest, 0.3^2 / 2 = 0.045), applied to different ratios at
    lag 1: on the engine factor it keeps the 3 stale tokens (6 of 8 kept), on the whole ratio none (3 of 8)."""
    from hand_dump import lag_dump

    dump = lag_dump(tmp_path / "d")
    out = tmp_path / "s"
    argv = ["analyze", str(dump), "--suggest", "--quantile", "0.6", "--suggest-options", "token_k2", "--out",
            str(out), "--no-plots", "--suggest-engine"]
    assert main(argv) == EXIT_OK
    report = json.loads((out / "suggest.json").read_text())
    (d,), (e,) = report["suggestions"], report["engine_suggestions"]
    assert d["threshold"] == e["threshold"] == pytest.approx(0.045, rel=1e-6) and e["population"] == 5
    assert (d["total"]["kept_tokens"], e["total"]["kept_tokens"]) == (3 / 8, 6 / 8)


@pytest.mark.unit
def test_engine_factor_left_out_or_refused_without_the_column(tmp_path, capsys):
    """Records 1.0 (the hand dump) and a 1.1 dump without version_log_probs: the whole-ratio suggestions as before
    and one line saying why there are none on the engine factor; --suggest-engine makes it an error naming the fix."""
    from hand_dump import lag_dump

    old = hand_dump(tmp_path / "old")
    assert main(["analyze", str(old), "--suggest", "--keep", "0.9", "--out", str(tmp_path / "s1"),
                 "--no-plots"]) == EXIT_OK
    text = capsys.readouterr().out
    (line,) = [t for t in text.splitlines() if t.startswith("RS on the engine factor")]
    assert "no suggestions: these are rollout records 1.0" in line and "policy_lag_split: true" in line
    report = json.loads((tmp_path / "s1" / "suggest.json").read_text())
    assert report["engine_suggestions"] == [] and "records 1.0" in report["engine_left_out"]
    assert len(report["suggestions"]) == len(RS_OPTIONS) + 2
    assert not list((tmp_path / "s1" / "suggest_configs").glob("*_engine.yaml"))
    assert main(["analyze", str(old), "--suggest", "--keep", "0.9", "--suggest-engine", "--no-plots"]) \
        == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--suggest-engine: no thresholds on the engine factor" in err and "policy_lag_split: true" in err
    assert not (old / "analysis").exists()
    # records 1.1 trained without policy_lag_split
    new = lag_dump(tmp_path / "new")
    step_file = next(new.glob("**/*.parquet"))
    table = pq.read_table(step_file)
    pq.write_table(table.drop_columns(["version_log_probs"]).replace_schema_metadata(table.schema.metadata),
                   step_file)
    assert main(["analyze", str(new), "--suggest", "--keep", "0.9", "--suggest-engine", "--no-plots"]) \
        == EXIT_BAD_INPUT
    assert "trained without policy_lag_split" in capsys.readouterr().err
    # only IS caps chosen: nothing to suggest on the engine factor (IS weights the whole ratio)
    assert main(["analyze", str(lag_dump(tmp_path / "l")), "--suggest", "--keep", "0.9", "--suggest-options",
                 "is_token", "--suggest-engine", "--no-plots"]) == EXIT_BAD_INPUT
    assert "chose only IS caps" in capsys.readouterr().err
    assert main(["analyze", str(old), "--suggest-engine"]) == EXIT_BAD_INPUT
    assert "belong to --suggest" in capsys.readouterr().err


def _comparable(fields: dict) -> dict:
    """Correction fields with thresholds as floats (a YAML value reaches the config as a string: '0.125' == 0.125)."""
    return {k: (float(v) if k.endswith("_threshold") and v is not None else v) for k, v in fields.items()}


@pytest.mark.unit
def test_every_emitted_yaml_loads_and_means_what_it_says(tmp_path):
    """A run trained with RS on the engine factor (token TIS at 2 + token_k2 <= 0.06 on pi_train@v / mu) on
    ``hand_dump.lag_dump``; --keep 0.6 writes one YAML per option (26). Each one loads through ``analyze --config``'s
    loader, and pasted over the trained config (as into the recipe) gives exactly the config that was re-applied
    for its comment (suggest.json's), thresholds round-tripped bit for bit; alone it keeps what its comment says.

    By hand (8 valid tokens, |e| = [0.1, 0.2, 0.3], [0.4, 0.5] at lag 0, [0.05, 0.15, 0.25] at lag 1, whose whole
    ratio is 1 nat larger):
    * the trained RS keeps |e| <= sqrt(0.12) = 0.346: 0.1, 0.2, 0.3 and the 3 stale tokens, 6 of 8 (on the whole
      ratio it would keep 3: the stale tokens' |l| >= 1.05). An IS cap keeps that RS, rollout_rs_on included;
    * is_token: the 5th smallest R = e^l is e^0.5; is_sequence: row sums 0.6, 0.9, 3.45, half-way between the
      2nd and the 3rd -> e^2.175;
    * token_k2 on the whole ratio: 0.5^2 / 2 = 0.125, with rollout_rs_on: direct written out: pasted without it
      over this recipe it would judge the engine factor (|e| <= 0.5 everywhere: 8 of 8 kept, not 5)."""
    import yaml

    from hand_dump import lag_dump
    from trl_rollout_corr.analyze import yaml_config
    from trl_rollout_corr.config import RolloutCorrectionConfig

    trained = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k2",
                                      rollout_rs_threshold=0.06, rollout_rs_on="engine")
    dump = lag_dump(tmp_path / "d", trained)
    out = tmp_path / "s"
    assert main(["analyze", str(dump), "--suggest", "--keep", "0.6", "--out", str(out), "--no-plots"]) == EXIT_OK
    report = json.loads((out / "suggest.json").read_text())
    by_name = {s.get("name", s["option"]): s for s in [*report["suggestions"], *report["engine_suggestions"]]}
    files = sorted((out / "suggest_configs").glob("*.yaml"))
    assert sorted(f.stem for f in files) == sorted(by_name) and len(files) == 2 * len(RS_OPTIONS) + 2
    recipe = {k: v for k, v in trained.to_dict().items() if v is not None}
    for path in files:
        s = by_name[path.stem]
        emitted = yaml.safe_load(path.read_text())
        alone = yaml_config(path).config
        if s["option"].startswith("is_"):
            assert (alone.rollout_is, float(alone.rollout_is_threshold)) == (s["option"][3:], s["threshold"])
        else:
            assert (alone.rollout_rs, float(alone.rollout_rs_threshold), alone.rollout_rs_on) \
                == (s["option"], s["threshold"], "engine" if path.stem.endswith("_engine") else "direct"), path.name
        merged_path = tmp_path / f"merged_{path.name}"
        merged_path.write_text(yaml.safe_dump({**recipe, **emitted}))
        merged = yaml_config(merged_path).config.to_dict()
        assert _comparable(merged) == _comparable(s["config"]), path.name
        comment = path.read_text().splitlines()[0]
        assert comment.endswith(f"{100 * s['kept']:.2f}%"), (path.name, comment)
        kept, population = _kept_count(s["option"], _reapplied(dump, path, tmp_path / path.stem))
        assert kept == pytest.approx(s["kept"] * population, abs=1e-9), path.name
    for option in ("is_token", "is_sequence"):
        s = by_name[option]
        assert s["config"]["rollout_rs"] == "token_k2" and s["config"]["rollout_rs_on"] == "engine"
        assert s["total"]["kept_tokens"] == 6 / 8 and s["by_lag"]["1"]["kept_tokens"] == 1.0
    assert by_name["is_token"]["threshold"] == pytest.approx(math.exp(0.5), rel=1e-6)  # float32 log-probs
    assert by_name["is_sequence"]["threshold"] == pytest.approx(math.exp(2.175), rel=1e-6)
    d = by_name["token_k2"]
    assert d["threshold"] == pytest.approx(0.125, rel=1e-6) and d["total"]["kept_tokens"] == 5 / 8
    without = {k: v for k, v in yaml.safe_load((out / "suggest_configs" / "token_k2.yaml").read_text()).items()
               if k != "rollout_rs_on"}
    (tmp_path / "pasted.yaml").write_text(yaml.safe_dump({**recipe, **without}))
    assert yaml_config(tmp_path / "pasted.yaml").config.rollout_rs_on == "engine"
    assert _reapplied(dump, tmp_path / "pasted.yaml", tmp_path / "pasted")["total"]["kept_tokens"] == 1.0
