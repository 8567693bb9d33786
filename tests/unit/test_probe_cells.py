"""benchmarks/probe_cells.py: its RESULTS.md table from committed probe reports, against hand-written values."""

import json

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def pc():
    return load_script("benchmarks/probe_cells.py")


def test_table_rows_from_reports(pc, tmp_path):
    for cell, mean, band in (("warmstart", 0.0088, 0.148), ("trl_k8_s1", -0.0518, 0.258)):
        (tmp_path / cell).mkdir()
        (tmp_path / cell / "report.json").write_text(json.dumps({"samples": 64, "log_ratio": {
            "tokens": 1000, "mean": mean, "mean_abs": 0.1439, "p99_abs": 2.1890, "max_abs": 3.221,
            "out_of_band": {"0.9_1.1": band}}}))
    text = pc.table(tmp_path, "policy_lag_intel")
    lines = text.splitlines()
    assert lines[0] == "<!-- BEGIN probe_cells.py output: policy_lag_intel -->"
    assert lines[-1] == "<!-- END probe_cells.py output: policy_lag_intel -->"
    assert "the first 16 held-out problems x 4 samples" in text  # 64 samples / 4 per prompt
    # sorted by cell name; -mean l is the KL(mu || pi_train) estimate, so the sign flips
    assert "| trl_k8_s1 | 1000 | 0.0518 | 0.1439 | 2.189 | 3.221 | 25.8 % |" in lines
    assert "| warmstart | 1000 | -0.0088 | 0.1439 | 2.189 | 3.221 | 14.8 % |" in lines
    assert lines.index("| trl_k8_s1 | 1000 | 0.0518 | 0.1439 | 2.189 | 3.221 | 25.8 % |") < lines.index(
        "| warmstart | 1000 | -0.0088 | 0.1439 | 2.189 | 3.221 | 14.8 % |")


def test_probe_refuses_a_folder_without_weights(pc, tmp_path):
    with pytest.raises(FileNotFoundError, match="--out folder"):
        pc.probe(tmp_path, tmp_path / "prompts.jsonl", tmp_path / "out")


def test_prompts_are_the_cells_held_out_problems(pc, tmp_path):
    pytest.importorskip("reasoning_gym")
    pc.write_prompts(tmp_path / "p.jsonl", 3)
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][0]["role"] == "user" for r in rows)
    # the first held-out item (eval seed 1000000), as the cells' greedy evaluation sees it
    assert "0 - 2 =" in rows[0]["messages"][0]["content"]
