"""The ``trl-rollout-corr`` command: the entry point, ``--help`` on every sub-command, ``analyze`` end to end with its
exit codes, and bad input (another schema version, a truncated Parquet file, a config that does not parse): a
clear error naming the file and the fix, and nothing overwritten."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from hand_dump import hand_dump
from trl_rollout_corr.cli import main
from trl_rollout_corr.console import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK

ROOT = Path(__file__).resolve().parents[2]


def test_entry_point_is_declared_and_importable():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"trl-rollout-corr": "trl_rollout_corr.cli:main"}
    module, _, attr = scripts["trl-rollout-corr"].partition(":")
    assert getattr(importlib.import_module(module), attr) is main


@pytest.mark.parametrize("argv, expected", [
    ([], ["analyze", "probe"]),
    (["analyze"], ["DUMP_DIR", "--preset", "--config", "--length-buckets", "--steps", "--tolerance", "--out"]),
    (["probe"], ["--model", "--engine", "--rollout-dtype", "--train-dtype", "--prompts", "--top-p", "--fail-above",
                 "--train-batch-size", "--no-fp32-lm-head"]),
])
def test_help_on_every_sub_command(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in expected:
        assert flag in text, flag


@pytest.fixture
def dump(tmp_path):
    return hand_dump(tmp_path / "dump")


def _analyze(*argv, capsys):
    code = main(["analyze", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_end_to_end(dump, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "band.yaml"
    cfg.write_text("label: k1 band\nrollout_rs: token_k1\nrollout_rs_threshold: 0.6_2.5\n")
    code, out, _ = _analyze(dump, "--preset", "decoupled_k3_rs", "--config", cfg, "--length-buckets", "2,3",
                            capsys=capsys)
    assert code == EXIT_OK
    # 57: the hand dump's empty slice [0, 2) logs only its num_seqs (tests/features/test_analyze.py)
    assert "57 rollout_corr/* values recomputed, max |diff| 0.00e+00" in out and ": OK" in out
    lines = [line for line in out.splitlines() if line.startswith(("trained", "decoupled_k3_rs", "k1 band"))]
    assert lines[0].split()[:3] == ["trained", "(decoupled_token_is)", "decoupled"]
    assert "60.0%" in lines[2]  # the k1 band keeps 3 of the 5 tokens (tests/features/test_analyze.py by hand)
    report = json.loads((dump / "analysis" / "analysis.json").read_text())
    assert [c["label"] for c in report["configs"]] == ["trained (decoupled_token_is)", "decoupled_k3_rs", "k1 band"]
    assert report["check"]["ok"] and report["configs"][2]["total"]["kept_tokens"] == pytest.approx(0.6)
    for name in ("analyze_per_step.png", "analyze_slices.png"):
        assert (dump / "analysis" / name).stat().st_size > 10_000
    # a second run does not overwrite without --overwrite
    before = (dump / "analysis" / "analysis.json").read_bytes()
    code, _, err = _analyze(dump, "--no-plots", capsys=capsys)
    assert code == EXIT_BAD_INPUT and "analysis.json already exists; nothing was written. Pass --overwrite" in err
    assert (dump / "analysis" / "analysis.json").read_bytes() == before
    assert _analyze(dump, "--no-plots", "--overwrite", capsys=capsys)[0] == EXIT_OK


def test_analyze_exit_1_when_the_logged_values_differ(tmp_path, capsys):
    good = hand_dump(tmp_path / "good")
    logged = json.loads((good / "logs.jsonl").read_text())["metrics"]
    logged["rollout_corr/k3_kl"] += 0.5
    bad = hand_dump(tmp_path / "bad", logged)
    code, out, _ = _analyze(bad, "--no-plots", capsys=capsys)
    assert code == EXIT_CHECK_FAILED and "MISMATCH" in out and "step 1: rollout_corr/k3_kl logged" in out
    assert _analyze(bad, "--no-plots", "--no-check", "--overwrite", capsys=capsys)[0] == EXIT_OK


def _outputs_untouched(dump: Path) -> bytes:
    (dump / "analysis").mkdir(exist_ok=True)
    (dump / "analysis" / "analysis.json").write_text("an earlier analysis\n")
    return (dump / "analysis" / "analysis.json").read_bytes()


def test_bad_input_names_the_file_and_overwrites_nothing(dump, tmp_path, capsys):
    earlier = _outputs_untouched(dump)
    # a config that does not parse
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("rollout_rs: seq_mean_k3\nrollout_rs_threshold: [0.01\n")
    code, _, err = _analyze(dump, "--config", cfg, "--overwrite", capsys=capsys)
    assert code == EXIT_BAD_INPUT and f"{cfg}:3:1: not valid YAML" in err and "Fix the syntax" in err
    # an unknown preset
    code, _, err = _analyze(dump, "--preset", "decoupled_k3_rss", "--overwrite", capsys=capsys)
    assert code == EXIT_BAD_INPUT and "Did you mean 'decoupled_k3_rs'" in err
    # a truncated Parquet file
    step_file = next((dump / "steps").iterdir())
    data = step_file.read_bytes()
    step_file.write_bytes(data[: len(data) // 3])
    code, _, err = _analyze(dump, "--no-plots", "--overwrite", capsys=capsys)
    assert code == EXIT_BAD_INPUT and f"{step_file}: not a readable Parquet file" in err and "Restore it" in err
    step_file.write_bytes(data)
    # a dump from another schema version
    run = json.loads((dump / "run.json").read_text())
    (dump / "run.json").write_text(json.dumps({**run, "schema_version": "2.0"}))
    code, _, err = _analyze(dump, "--no-plots", "--overwrite", capsys=capsys)
    assert code == EXIT_BAD_INPUT and f"{dump / 'run.json'}: rollout records schema 2.0" in err
    # not a dump at all
    code, _, err = _analyze(tmp_path, "--no-plots", capsys=capsys)
    assert code == EXIT_BAD_INPUT and "is not a rollout dump (no run.json)" in err
    assert (dump / "analysis" / "analysis.json").read_bytes() == earlier
    code, _, err = _analyze(dump, "--no-plots", "--out", tmp_path / "fresh", "--config", cfg, capsys=capsys)
    assert code == EXIT_BAD_INPUT and not (tmp_path / "fresh").exists()  # not even an empty folder


def test_a_deleted_step_file_is_reported_not_checked(tmp_path, capsys):
    dump = hand_dump(tmp_path / "d")
    # a second logged step whose file is then deleted (as the truncated-file error suggests)
    shutil.copy(next((dump / "steps").iterdir()), dump / "steps" / "step-00000002.rank-00000.parquet")
    line = json.loads((dump / "logs.jsonl").read_text())
    (dump / "logs.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({**line, "logged_step": 2,
                                                                           "first_step": 2}) + "\n")
    (dump / "steps" / "step-00000002.rank-00000.parquet").unlink()
    code, out, _ = _analyze(dump, "--no-plots", capsys=capsys)
    assert code == EXIT_OK and "step 2 not checked: its step file is missing" in out


def test_plots_without_matplotlib_name_the_extra(dump, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = _analyze(dump, capsys=capsys)
    assert code == EXIT_BAD_INPUT
    assert "pip install 'trl-rollout-corr[cpu]'" in err and "--no-plots" in err
    assert not (dump / "analysis" / "analysis.json").exists()  # failed before writing anything
    assert _analyze(dump, "--no-plots", capsys=capsys)[0] == EXIT_OK


@pytest.mark.parametrize("flags, message", [
    (["--length-buckets", "32,4"], "--length-buckets '32,4': length_buckets must be strictly increasing positive"),
    (["--length-buckets", "0"], "--length-buckets '0': length_buckets must be strictly increasing positive"),
    (["--length-buckets", "8,x"], "--length-buckets '8,x': expected comma-separated integers"),
    (["--tolerance", "-1"], "--tolerance -1.0: tolerance must be a finite number >= 0"),
    (["--tolerance", "nan"], "--tolerance nan: tolerance must be a finite number >= 0"),
    (["--tolerance", "inf"], "--tolerance inf: tolerance must be a finite number >= 0"),
])
def test_bad_flag_values_are_usage_errors_not_tracebacks(dump, flags, message, capsys):
    """Issue 22: ``--length-buckets 32,4`` / ``0`` raised a traceback with the check-failed code, and a negative or
    NaN ``--tolerance`` was accepted and then reported MISMATCH on an exact reproduction."""
    code, out, err = _analyze(dump, "--no-plots", *flags, capsys=capsys)
    assert code == EXIT_BAD_INPUT and message in err and "Traceback" not in err
    assert not (dump / "analysis").exists()  # refused before any work


def test_tolerance_zero_and_fine_buckets_are_accepted(dump, capsys):
    code, out, _ = _analyze(dump, "--no-plots", "--tolerance", "0", "--length-buckets", "1,2", capsys=capsys)
    assert code == EXIT_OK and "(tolerance 0 x max(1, |value|)): OK" in out  # the hand dump reproduces bit for bit


def test_an_unknown_key_in_a_what_if_config_is_refused(dump, tmp_path, capsys):
    """Issue 22: ``rs_threshold: 0.05`` was silently ignored and the what-if ran at the preset's value."""
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("rollout_corr_preset: decoupled_k3_rs\nrs_threshold: 0.05\n")
    code, _, err = _analyze(dump, "--no-plots", "--config", cfg, capsys=capsys)
    assert code == EXIT_BAD_INPUT
    assert f"{cfg}: unknown key 'rs_threshold'; did you mean 'rollout_rs_threshold'?" in err
    assert "Correction keys: bypass_loss_type, bypass_mode, rollout_corr_preset, rollout_is," in err
    cfg.write_text("rollout_corr_preset: decoupled_k3_rs\nrouting_replay: r3\n")
    code, _, err = _analyze(dump, "--no-plots", "--config", cfg, capsys=capsys)
    assert code == EXIT_BAD_INPUT and "unknown key 'routing_replay' (a training setting" in err
    cfg.write_text("rollout_corr_preset: decoupled_k3_rs\nwhatever: 1\n")
    code, _, err = _analyze(dump, "--no-plots", "--config", cfg, capsys=capsys)
    assert code == EXIT_BAD_INPUT and "unknown key 'whatever'. Correction keys:" in err
