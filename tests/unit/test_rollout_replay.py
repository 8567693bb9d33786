"""benchmarks/rollout_replay.py: a replayed run sees the recorded outputs and continues with the recorded random
states, exactly; any difference in the call raises; and the policy-lag runner's choice of which cells replay."""

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    sys.path.insert(0, str(_BENCH))
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rr():
    return _load("rollout_replay")


class FakeRollout:
    """Samples from the three global generators, as an in-process engine may."""

    def __init__(self):
        self.n = 0

    def __call__(self, prompts, trainer):
        self.n += 1
        return {"prompt_ids": [[len(p)] for p in prompts],
                "completion_ids": [[int(torch.randint(0, 100, ())), random.randrange(100), int(np.random.randint(100))]
                                   for _ in prompts],
                "logprobs": [[float(torch.rand(())) - 1.0 / 3.0] * 3 for _ in prompts],
                "policy_version": [0] * len(prompts)}

    def describe(self):
        return {"rollout_engine": "fake"}

    def sampling_kwargs(self, trainer):
        return {"temperature": 1.0, "max_tokens": 3}

    @staticmethod
    def tokenize(prompts, trainer):
        return [[len(p)] for p in prompts]


class Forbidden(FakeRollout):
    """The same engine description, but a replay must never call it."""

    def __call__(self, prompts, trainer):
        raise AssertionError("a replay generated")


def _seed():
    torch.manual_seed(0), random.seed(0), np.random.seed(0)


def _model(*values):
    model = torch.nn.Module()
    model.register_buffer("w", torch.tensor(values or (1.0, 2.0)))
    return model


def _train(wrapped, steps, prompts=lambda s: [f"q{s}", f"r{s}x"], model=None):
    """Three 'optimizer steps': a rollout call, then training draws from the generators; returns everything seen."""
    trainer, seen = SimpleNamespace(state=SimpleNamespace(global_step=0), model=model or _model()), []
    for step in range(steps):
        trainer.state.global_step = step
        seen.append(wrapped(prompts(step), trainer))
        seen.append((float(torch.rand(())), random.random(), float(np.random.rand())))
    return seen


def test_replay_returns_the_outputs_and_the_random_stream_of_the_recorded_run(rr, tmp_path):
    path = tmp_path / "rollouts.json.gz"
    _seed()
    recorded = _train(rr.RecordedRollout(FakeRollout(), path, "record"), 3)
    _seed()
    replay = rr.RecordedRollout(Forbidden(), path, "replay")
    assert _train(replay, 3) == recorded  # the outputs, bit for bit (floats round-trip), and the draws after them
    assert replay.replayed == 3 and len(rr.load_recording(path)) == 3
    assert replay.describe() == {"rollout_engine": "fake"}  # delegated
    _seed()  # a shorter run replays a prefix
    assert _train(rr.RecordedRollout(Forbidden(), path, "replay"), 2) == recorded[:4]


def test_replay_refuses_a_call_that_differs(rr, tmp_path):
    path = tmp_path / "rollouts.json.gz"
    _seed()
    _train(rr.RecordedRollout(FakeRollout(), path, "record"), 2)
    _seed()
    with pytest.raises(RuntimeError, match=f"^{rr.MISMATCH}: .*prompts_sha256"):
        _train(rr.RecordedRollout(Forbidden(), path, "replay"), 2, prompts=lambda s: ["other"])
    _seed()  # other weights at the first call: the engine would have sampled from them
    with pytest.raises(RuntimeError, match=r"\['weights_sha256'\]"):
        _train(rr.RecordedRollout(Forbidden(), path, "replay"), 1, model=_model(1.0, 2.5))
    _seed()  # the same messages tokenised otherwise (a chat template or tokenizer change)
    other_ids = Forbidden()
    other_ids.tokenize = lambda prompts, trainer: [[len(p) + 1] for p in prompts]
    with pytest.raises(RuntimeError, match=r"\['prompt_ids'\]"):
        _train(rr.RecordedRollout(other_ids, path, "replay"), 1)
    _seed()  # another machine (torch, CPU, threads)
    real = rr.machine
    rr.machine = lambda: {**real(), "cpu": "another CPU"}
    try:
        with pytest.raises(RuntimeError, match=r"\['machine'\].*another CPU"):
            _train(rr.RecordedRollout(Forbidden(), path, "replay"), 1)
    finally:
        rr.machine = real
    torch.manual_seed(1), random.seed(0), np.random.seed(0)  # another random state before the first call
    with pytest.raises(RuntimeError, match="rng_before"):
        _train(rr.RecordedRollout(Forbidden(), path, "replay"), 1)
    _seed()
    with pytest.raises(RuntimeError, match="holds 2 rollout calls"):
        _train(rr.RecordedRollout(Forbidden(), path, "replay"), 3)
    with pytest.raises(ValueError, match="mode"):
        rr.RecordedRollout(Forbidden(), path, "both")


def test_an_output_json_would_change_stops_the_recording_not_the_run(rr, tmp_path):
    class Tuples(FakeRollout):
        def __call__(self, prompts, trainer):
            return {**super().__call__(prompts, trainer), "policy_version": (0,) * len(prompts)}

    path = tmp_path / "rollouts.json.gz"
    wrapped = rr.RecordedRollout(Tuples(), path, "record")
    out = _train(wrapped, 2)
    assert out[0]["policy_version"] == (0, 0) and wrapped.rollout.n == 2
    assert wrapped.calls is None and "call 0" in wrapped.stopped and not path.exists()


def test_which_cells_replay(rr, tmp_path):
    exp = _load("policy_lag_experiment")
    assert exp.REPLAY_MISMATCH == rr.MISMATCH  # run_cell generates instead only on this message
    args = argparse.Namespace(results=str(tmp_path), steps=32, out=str(tmp_path / "out"), lr=3e-5, prompts=8)

    def flags(name):
        return exp.cell_flags(name, tmp_path / "out" / name, args)

    assert exp.rollout_plan("warmstart", [], args) == ("generate", None)
    assert exp.rollout_plan("tis_k8_s1", flags("tis_k8_s1"), args) == ("generate", None)  # syncs: weights move
    assert exp.rollout_plan("tis_k32_s1", flags("tis_k32_s1"), args) == ("record", None)
    done = tmp_path / "bypass_k32_s1"
    done.mkdir()
    (done / "cell_meta.json").write_text(json.dumps({"flags": flags("bypass_k32_s1")}))
    assert exp.rollout_plan("tis_k32_s1", flags("tis_k32_s1"), args) == ("record", None)  # no recording there
    (done / exp.ROLLOUTS).write_bytes(b"")
    assert exp.rollout_plan("tis_k32_s1", flags("tis_k32_s1"), args) == ("replay", done / exp.ROLLOUTS)
    assert exp.rollout_plan("trl_slow_k32_s1", flags("trl_slow_k32_s1"), args)[0] == "replay"  # lr: training only
    assert exp.rollout_plan("tis_k32_s2", flags("tis_k32_s2"), args) == ("record", None)  # another seed
    assert exp.rollout_plan("bypass_k32_s1", flags("bypass_k32_s1"), args) == ("record", None)  # not itself
    assert exp.rollout_key(flags("tis_k32_s2"))["--seed"] == "43"


def test_report_checks_that_a_seeds_never_synced_cells_saw_the_same_rollouts(tmp_path):
    exp = _load("policy_lag_experiment")

    def cell(rewards, how="generate"):
        return {"steps": [{"reward": r, "completions/mean_length": 10.0} for r in rewards], "meta": {"rollouts": how}}

    cells = {"trl_k32_s1": cell([0.1, 0.2]), "tis_k32_s1": cell([0.1, 0.2], "replayed from bypass_k32_s1"),
             "bypass_k32_s1": cell([0.1, 0.2], "record"), "trl_k32_s2": cell([0.3, 0.4]),
             "tis_k8_s1": cell([0.5, 0.6])}
    assert exp.same_rollouts(cells) == [  # seed 2 has one cell, k = 8 syncs: no line
        "* k = 32, seed 1: per-step reward and completions/mean_length identical in all 3 cells (trl_k32_s1, "
        "tis_k32_s1, bypass_k32_s1)."]
    cells["tis_k32_s1"] = cell([0.1, 0.25], "replayed from bypass_k32_s1")
    assert exp.same_rollouts(cells) == ["* k = 32, seed 1: DIFFERENT rollouts: tis_k32_s1 vs trl_k32_s1 at steps [2]."]


def test_the_warm_start_is_rebuilt_from_its_committed_code_revision(tmp_path, monkeypatch):
    """Today's code may move training values in the last bits: the rebuild runs the committed revision's tree."""
    exp = _load("policy_lag_experiment")
    results = tmp_path / "warmstart"
    results.mkdir()
    calls = []
    monkeypatch.setattr(exp, "_git", lambda repo, *a: calls.append((repo, a)))
    monkeypatch.setattr(exp, "code_revision", lambda: "b" * 40)
    (results / "cell_meta.json").write_text(json.dumps({"code": "b" * 40}))
    assert exp.warmstart_tree(results, tmp_path / "out") == exp.ROOT and not calls  # the same revision: here
    (results / "cell_meta.json").write_text(json.dumps({"code": "a" * 40}))
    tree = exp.warmstart_tree(results, tmp_path / "out")
    assert tree == tmp_path / "out" / ("warmstart_code_" + "a" * 12)
    assert calls == [(exp.ROOT, ("worktree", "add", "--detach", "-f", str(tree), "a" * 40))]
    (results / "cell_meta.json").write_text(json.dumps({"code": "a" * 40 + "+dirty"}))
    with pytest.raises(RuntimeError, match=r"uncommitted changes .* no revision rebuilds it"):
        exp.warmstart_tree(results, tmp_path / "out")
