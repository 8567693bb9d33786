"""Issue 44, items 4, 5 and the minor CLI list: bad command lines are refused with exit 2 before any work, naming the
flag or the file and the fix.

* ``--out`` naming an existing file (``analyze``, ``analyze --suggest``, ``probe``): they did all their work, then
  failed with a ``FileExistsError`` traceback and exit 1, nothing written;
* ``probe --fail-above nan`` could never fail (a CI gate silently off) and ``--top-tokens -3`` listed all but 3;
* ``analyze --suggest`` silently ignored ``--tolerance`` and ``--no-check``;
* ``analyze --steps`` cutting a generation batch exited 1 with "NO VALUES COMPARED" instead of saying so.
"""

from __future__ import annotations

import pytest
import torch

from hand_dump import hand_dump
from trl_rollout_corr.cli import main
from trl_rollout_corr.console import EXIT_BAD_INPUT, EXIT_OK
from trl_rollout_corr.records import MicroBatch, RolloutRecordWriter


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("suggest", [False, True], ids=["analyze", "suggest"])
def test_analyze_out_naming_a_file_is_refused_before_any_work(tmp_path, capsys, suggest):
    dump = hand_dump(tmp_path / "dump")
    target = tmp_path / "report.txt"
    target.write_text("keep me")
    extra = ["--suggest", "--keep", "0.9"] if suggest else []
    for out in (target, target / "sub"):  # the file itself, or a folder under it
        code, stdout, err = _run(["analyze", dump, *extra, "--no-plots", "--out", out], capsys)
        assert code == EXIT_BAD_INPUT, (out, err)
        assert f"{target} is an existing file, not a folder; nothing was written" in err and "Traceback" not in err
        assert "Dump " not in stdout and "Suggested" not in stdout  # refused before reading the dump
    assert target.read_text() == "keep me"
    # --overwrite replaces files in a folder, never a file by a folder
    code, _, err = _run(["analyze", dump, *extra, "--no-plots", "--overwrite", "--out", target], capsys)
    assert code == EXIT_BAD_INPUT and "is an existing file, not a folder" in err


def test_probe_out_naming_a_file_and_bad_gate_values_are_refused(llama_dir, tmp_path, capsys):
    target = tmp_path / "probe.json"
    target.write_text("{}")
    base = ["probe", "--model", llama_dir, "--engine", "transformers", "--rollout-dtype", "float32",
            "--train-dtype", "float32", "--num-prompts", "1", "--samples-per-prompt", "1", "--max-tokens", "2",
            "--no-plots", "--threads", "1"]
    code, out, err = _run([*base, "--out", target], capsys)
    assert code == EXIT_BAD_INPUT and f"{target} is an existing file, not a folder" in err
    assert out == "" and target.read_text() == "{}"  # nothing sampled, nothing written
    fresh = tmp_path / "fresh"
    for flags, message in [
        (["--fail-above", "nan"], "--fail-above nan: a CI gate needs a finite threshold"),
        (["--fail-above", "inf"], "--fail-above inf: a CI gate needs a finite threshold"),
        (["--top-tokens", "-3"], "--top-tokens -3: the number of most mismatched tokens to show must be >= 0"),
    ]:
        code, out, err = _run([*base, "--out", fresh, *flags], capsys)
        assert code == EXIT_BAD_INPUT and message in err, (flags, err)
        assert out == "" and not fresh.exists()


@pytest.mark.parametrize("flags, named", [
    (["--tolerance", "1e-3"], "--tolerance belongs"),
    (["--no-check"], "--no-check belongs"),
    (["--tolerance", "0", "--no-check"], "--tolerance and --no-check belong"),
])
def test_suggest_refuses_the_check_flags(tmp_path, capsys, flags, named):
    dump = hand_dump(tmp_path / "dump")
    code, out, err = _run(["analyze", dump, "--suggest", "--keep", "0.9", "--no-plots", *flags], capsys)
    assert code == EXIT_BAD_INPUT and named in err and "--suggest checks nothing against the logs" in err
    assert not (dump / "analysis").exists()
    # without them --suggest runs
    assert _run(["analyze", dump, "--suggest", "--keep", "0.9", "--no-plots"], capsys)[0] == EXIT_OK


def _two_step_generation_dump(path):
    """One generation batch of 4 rows trained over two optimizer steps (steps_per_generation 2, micro-batch 2), each
    step logged: logged step 1 holds rows 0-1, logged step 2 rows 2-3."""
    w = RolloutRecordWriter(path, eos_token_ids=[1], pad_token_id=0, max_completion_length=3)
    w.write_run_metadata({
        "schema": "trl-rollout-corr/rollout-records", "schema_version": "1.1",
        "correction": {"rollout_is": "token", "rollout_is_threshold": 2.0, "mode": "decoupled",
                       "length_buckets": [2, 3], "rollout_corr_preset": "decoupled_token_is"},
        "trainer": {"per_device_train_batch_size": 2, "steps_per_generation": 2}, "model": {}, "engine": {},
    })
    mu = torch.full((2, 3), -1.0)
    for step in (0, 1):
        w.add(MicroBatch(step=step, generation_step=0, generation_batch=0, prompt_ids=torch.full((2, 1), 2),
                         prompt_mask=torch.ones(2, 1), completion_ids=torch.tensor([[5, 6, 1], [7, 7, 1]]),
                         completion_mask=torch.ones(2, 3, dtype=torch.int64), rollout_log_probs=mu,
                         advantages=torch.zeros(2), generation_row=torch.tensor([2 * step, 2 * step + 1]),
                         per_token=dict(old_log_probs=mu, log_probs=mu)))
        w.end_window(step + 1, {"rollout_corr/kl": 0.0})
    return path


def test_steps_that_cut_a_generation_batch_are_refused(tmp_path, capsys):
    dump = _two_step_generation_dump(tmp_path / "dump")
    for steps, rest in (("1:1", "2"), ("2:", "1")):
        code, out, err = _run(["analyze", dump, "--no-plots", "--steps", steps], capsys)
        assert code == EXIT_BAD_INPUT, (steps, out, err)
        assert f"cuts generation batch 0: the rest of its rows were trained in logged step(s) {rest}" in err
        assert "--steps 1:2" in err and not (dump / "analysis").exists()
    # the whole batch: analysed and checked (kl 0 logged, recomputed 0)
    code, out, _ = _run(["analyze", dump, "--no-plots", "--steps", "1:2"], capsys)
    assert "cuts generation batch" not in out and "values recomputed" in out


def test_probe_gate_fails_on_non_finite_measurements():
    """``--fail-above``: a NaN statistic (``nan > X`` is False) or NaN/inf log ratios left out of the statistics
    (``log_ratio_stats`` keeps finite tokens only) used to pass the gate; both fail it now."""
    import math

    from trl_rollout_corr import probe

    def report(mean_abs, non_finite, sc_max=0.0, sc_non_finite=0):
        return {"log_ratio": {"mean_abs": mean_abs, "non_finite": non_finite, "out_of_band": {"0.9_1.1": 0.0}},
                "self_consistency": {"max_abs": sc_max, "non_finite": sc_non_finite}}

    assert probe.gate(report(0.01, 0), "mean_abs", 0.05)[0]["failed"] is False
    assert probe.gate(report(0.10, 0), "mean_abs", 0.05)[0]["failed"] is True
    fail, text = probe.gate(report(0.01, 3), "mean_abs", 0.05)
    assert fail == {"metric": "mean_abs", "value": 0.01, "threshold": 0.05, "non_finite": 3, "failed": True}
    assert "and 3 non-finite log ratio(s) left out of it vs 0.05: FAIL" in text
    fail, _ = probe.gate(report(math.nan, 0), "mean_abs", 0.05)
    assert fail["failed"] is True and math.isnan(fail["value"])
    assert probe.gate(report(0.01, 0, sc_max=math.inf), "self_consistency_max_abs", 1.0)[0]["failed"] is True
    assert probe.gate(report(0.01, 0, sc_non_finite=1), "self_consistency_max_abs", 1.0)[0]["failed"] is True
    assert probe.gate(report(0.01, 2, sc_non_finite=0), "self_consistency_max_abs", 1.0)[0]["failed"] is False
    assert probe.fail_value(report(0.01, 0), "out_of_band") == 0.0
