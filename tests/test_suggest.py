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
