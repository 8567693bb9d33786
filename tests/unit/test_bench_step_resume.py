"""benchmarks/bench_step.py's ``--resume``: finished (round, run) pairs are kept, failed ones run again."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_step", _PATH)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_step", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_resume_reruns_failed_pairs_only(bench, tmp_path, monkeypatch):
    (tmp_path / "rollouts.pt").write_bytes(b"")  # present: no sampling
    finished = {"run": "ours_bypass", "round": 0, "steps": [{"cpu_s": 1.0}], "logs": [], "calibration_s": None,
                "load_before": 0.0}
    failed = {"run": "ours_decoupled", "round": 0, "error": "rc 1: RuntimeError"}
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"command": "first"}, "runs": [finished, failed]}))
    calls = []

    def fake_subprocess(args, extra, log):
        name, rnd = extra[1], int(extra[3])
        calls.append((rnd, name))
        log.write_text("ok\n")
        record = {**finished, "run": name, "round": rnd, "steps": [{"cpu_s": 2.0}]}
        (tmp_path / "runs" / f"r{rnd}_{name}.json").write_text(json.dumps(record))
        return subprocess.CompletedProcess([], 0)

    monkeypatch.setattr(bench, "_subprocess", fake_subprocess)
    monkeypatch.setattr(bench, "_report", lambda results, args: 0)
    monkeypatch.setattr(bench, "available_runs", lambda: ["ours_decoupled", "ours_bypass"])
    assert bench.main(["--rounds", "1", "--resume", "--runs", "ours_decoupled,ours_bypass", "--out",
                       str(tmp_path)]) == 0
    assert calls == [(0, "ours_decoupled")]  # the failed pair again, the finished one kept
    runs = {(r["round"], r["run"]): r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert set(runs) == {(0, "ours_decoupled"), (0, "ours_bypass")}
    assert "error" not in runs[(0, "ours_decoupled")] and runs[(0, "ours_decoupled")]["steps"] == [{"cpu_s": 2.0}]
    assert runs[(0, "ours_bypass")]["steps"] == [{"cpu_s": 1.0}]
