"""``checkpoint_state``: every feature's ``state_dict`` in one file per rank of each checkpoint, read back on resume;
its refusals. On stand-in trainers (the real ones: ``tests/features/test_resume_features.py``)."""

from __future__ import annotations

import types

import pytest
import torch

from trl_rollout_corr import checkpoint_state
from trl_rollout_corr.hooks import Feature


class _Counter(Feature):
    name = "counter"

    def __init__(self, count=0, weights=None):
        self.count, self.weights = count, weights

    def state_dict(self):
        return {"count": self.count, "weights": self.weights}

    def load_state_dict(self, state):
        self.count, self.weights = state["count"], state["weights"]


class _Plain(Feature):
    name = "plain"

    def __init__(self):
        super().__init__(None)


def _trainer(features, step=5, rank=0, world=1):
    return types.SimpleNamespace(rollout_corr_features=features, state=types.SimpleNamespace(global_step=step),
                                 accelerator=types.SimpleNamespace(process_index=rank, num_processes=world))


def test_every_feature_state_round_trips_in_one_file_per_rank(tmp_path):
    weights = {0: {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, 3: {"w": torch.full((2, 3), 0.5)}}
    path = checkpoint_state.save(_trainer([_Plain(), _Counter(7, weights)], rank=1, world=2), tmp_path / "ck")
    assert path == tmp_path / "ck" / "rollout_corr_features.rank-00001.pt"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    saved = torch.load(path, weights_only=True)
    assert {k: saved[k] for k in ("format", "global_step", "rank", "world_size", "features")} == {
        "format": 1, "global_step": 5, "rank": 1, "world_size": 2, "features": ["plain", "counter"]}
    assert saved["state"]["plain"] == {}
    back = _Counter()
    checkpoint_state.load(_trainer([_Plain(), back], rank=1, world=2), tmp_path / "ck")
    assert back.count == 7 and sorted(back.weights) == [0, 3]
    assert torch.equal(back.weights[0]["w"], weights[0]["w"]) and torch.equal(back.weights[3]["w"], weights[3]["w"])


def test_a_file_of_another_step_is_refused_and_another_world_size_starts_fresh(tmp_path, caplog):
    checkpoint_state.save(_trainer([_Plain(), _Counter(1)]), tmp_path)
    with pytest.raises(ValueError, match=r"of another format or step than this run resumes at \(step 6, format 1\)"):
        checkpoint_state.load(_trainer([_Plain(), _Counter()], step=6), tmp_path)
    caplog.set_level("WARNING", logger="trl_rollout_corr.checkpoint_state")
    back = _Counter(3)  # saved by 1 process, resumed on 2: every feature starts fresh (plain TRL resumes there too)
    trainer = _trainer([_Plain(), back])
    trainer.accelerator.num_processes = 2
    assert checkpoint_state.load(trainer, tmp_path) == ["plain", "counter"] and back.count == 3
    assert "its feature state was saved by 1 processes, this run has 2" in caplog.text


def test_missing_state_starts_those_features_fresh_with_one_warning(tmp_path, caplog):
    """No file (plain TRL's checkpoint, an older version's): every feature starts fresh; a stateful one is named in
    the warning, a stateless one is not. Other features than the checkpoint's: the common ones are restored."""
    caplog.set_level("WARNING", logger="trl_rollout_corr.checkpoint_state")
    fresh = _Counter(9)
    assert checkpoint_state.load(_trainer([_Plain(), fresh], rank=1, world=2), tmp_path) == ["plain", "counter"]
    assert fresh.count == 9  # untouched: it starts from what __init__ gave it
    assert len(caplog.records) == 1 and "it has no rollout_corr_features.rank-00001.pt" in caplog.text
    assert "start fresh: ['counter']; saved state left unused: []" in caplog.text
    caplog.clear()
    assert checkpoint_state.load(_trainer([_Plain()]), tmp_path) == ["plain"]  # nothing stateful: no warning
    assert not caplog.records

    checkpoint_state.save(_trainer([_Plain(), _Counter(1)]), tmp_path)
    assert checkpoint_state.load(_trainer([_Plain()]), tmp_path) == []
    assert "start fresh: []; saved state left unused: ['counter']" in caplog.text
    caplog.clear()
    back = _Counter()
    assert checkpoint_state.load(_trainer([back]), tmp_path) == []  # "plain" (stateless) dropped: no warning
    assert back.count == 1 and not caplog.records


def test_a_feature_without_state_refuses_state():
    plain = _Plain()
    assert plain.state_dict() == {}
    plain.load_state_dict({})
    with pytest.raises(ValueError, match=r"plain: the checkpoint holds state \['x'\] for a feature that keeps none"):
        plain.load_state_dict({"x": 1})


def test_a_checkpoint_with_the_files_of_some_ranks_only_starts_fresh_on_every_rank(tmp_path):
    """A checkpoint holding rank 0's file but not rank 1's (saved on 1 process, or copied from one node of a run
    without a shared filesystem): if rank 0 restored and rank 1 started fresh, the features' collectives would differ
    across ranks (the split's held versions, support matching's one-time measurement: a hang). Both start fresh; a
    file of another step on one rank only is refused on both."""
    from thread_ranks import run_ranks

    checkpoint_state.save(_trainer([_Plain(), _Counter(4)], rank=0, world=2), tmp_path)

    def resume(rank, reducers, step=5):
        counter = _Counter(-1)
        trainer = _trainer([_Plain(), counter], rank=rank, world=2, step=step)
        trainer.rollout_corr_reducers = reducers
        try:
            return checkpoint_state.load(trainer, tmp_path), counter.count
        except ValueError as e:
            return str(e)

    assert run_ranks(2, resume) == [(["plain", "counter"], -1), (["plain", "counter"], -1)]
    checkpoint_state.save(_trainer([_Plain(), _Counter(4)], rank=1, world=2, step=4), tmp_path)  # rank 1: step 4
    messages = run_ranks(2, resume)
    assert messages[0] == messages[1] and "of another format or step than this run resumes at (step 5" in messages[0]


def test_the_file_is_written_before_a_checkpoint_push_once_and_every_rank_waits(tmp_path):
    """``save_before_push`` (``RolloutCorrGRPOTrainer._push_from_checkpoint``): with a checkpoint push the file is
    written, every rank waits, and ``on_save`` of that checkpoint does not write it again; with
    ``hub_strategy="end"`` (no checkpoint push) or no push at all, nothing is written there and nobody waits, and
    ``on_save`` writes it as always."""
    waits = []

    def trainer(push, strategy, step):
        t = _trainer([_Counter(step)], step=step)
        t.accelerator.wait_for_everyone = lambda: waits.append(step)
        t.args = types.SimpleNamespace(push_to_hub=push, hub_strategy=strategy, output_dir=str(tmp_path))
        t.rollout_corr_state_saved = None
        return t

    t = trainer(True, "checkpoint", 3)
    path = checkpoint_state.save_before_push(t, tmp_path / "checkpoint-3")
    assert path == tmp_path / "checkpoint-3" / "rollout_corr_features.rank-00000.pt"
    assert torch.load(path, weights_only=True)["state"]["counter"]["count"] == 3 and waits == [3]
    assert t.rollout_corr_state_saved == (str(tmp_path / "checkpoint-3"), 3)
    stamp = path.stat().st_mtime_ns
    t.rollout_corr_features[0].count = 99  # had on_save written again, the file would say 99
    checkpoint_state.callback(t).on_save(t.args, t.state, None)
    assert torch.load(path, weights_only=True)["state"]["counter"]["count"] == 3 and path.stat().st_mtime_ns == stamp
    for push, strategy in ((True, "end"), (False, "checkpoint")):
        t = trainer(push, strategy, 4)
        assert checkpoint_state.save_before_push(t, tmp_path / "checkpoint-4") is None
        assert not (tmp_path / "checkpoint-4").exists() and waits == [3]
        checkpoint_state.callback(t).on_save(t.args, t.state, None)  # the next checkpoint: on_save writes it
        saved = torch.load(tmp_path / "checkpoint-4" / "rollout_corr_features.rank-00000.pt", weights_only=True)
        assert saved["global_step"] == 4 and saved["state"]["counter"]["count"] == 4
        (tmp_path / "checkpoint-4" / "rollout_corr_features.rank-00000.pt").unlink()
        (tmp_path / "checkpoint-4").rmdir()
