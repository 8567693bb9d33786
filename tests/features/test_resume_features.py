"""Resuming from a checkpoint with the newest features on: RS on the lag split's engine factor with stale rollouts
and ``max_policy_lag``, M2PO (with the pi_old elision), KPop in bypass mode, each with rollout records.

Each test trains N steps saving a checkpoint, then a fresh trainer (and a fresh engine, as after a crash) resumes
from it into the same dump. The resumed steps must be the uninterrupted run's: loss, grad norm and every
``rollout_corr/*`` value, to the tolerance of the recipe's resume test (``test_recipe_tiny``: rel 1e-5, abs 1e-7), and
the continued dump must hold every step once. The engine's state (its weights and sync schedule) lives in the
``rollout_func``, not in the checkpoint: the checkpoints here are at weight syncs, where a restarted engine takes
the same weights as the uninterrupted one (``docs/how-to/policy-lag.md``, "Resuming from a checkpoint").
"""

from __future__ import annotations

import json

import pytest

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("_silence_trl_experimental")]

REL, ABS = 1e-5, 1e-7  # test_recipe_tiny's resume tolerance
OUTLIER = 0.3  # nats: the noisy engine's mu is this much too low on completion positions 1, 4, 7, ...


class _NoisyEngine(StaleRollout):
    """``StaleRollout`` whose mu is ``OUTLIER`` nats low on every third completion token: outliers in the engine
    factor pi_train@v / mu, next to the staleness that is in the lag factor only."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        out["logprobs"] = [[lp - OUTLIER if j % 3 == 1 else lp for j, lp in enumerate(row)] for row in out["logprobs"]]
        return out


def _args(tmp_path, **overrides):
    from conftest import _make_args

    return _make_args(tmp_path, **{"save_strategy": "steps", "rollout_dump_dir": str(tmp_path / "dump"), **overrides})


def _train_and_resume(tmp_path, make, checkpoint):
    """``make()`` -> a trainer; trains it to the end (saving ``checkpoint-<checkpoint>``), then a second ``make()``
    resumes from that checkpoint into the same output and dump. Returns (first, resumed)."""
    first = make()
    first.train()
    resumed = make()
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / f"checkpoint-{checkpoint}"))
    return first, resumed


def _assert_same_steps(first, resumed, steps, generated=None):
    """The resumed run's log records of ``steps`` equal the uninterrupted run's: the same keys, and loss, grad norm
    and every rollout_corr/* value to REL/ABS (the generation-time ones at the steps in ``generated``, default all,
    that generated). Returns the uninterrupted run's records of those steps."""
    full = {h["step"]: h for h in first.state.log_history if "loss" in h}
    again = {h["step"]: h for h in resumed.state.log_history[-len(steps) - 1:] if "loss" in h}  # and train_runtime
    assert sorted(again) == list(steps) and resumed.state.global_step == steps[-1]
    for step in steps:
        a, b = full[step], again[step]
        keys = sorted(k for k in a if k.startswith("rollout_corr/"))
        assert keys == sorted(k for k in b if k.startswith("rollout_corr/")), step
        if generated is None or step in generated:
            assert "rollout_corr/policy_lag_mean" in keys and "rollout_corr/num_valid_tokens" in keys
        else:  # a second iteration: no generation, no correction call; the ratios of its loss forward
            assert "rollout_corr/num_valid_tokens" not in keys and "rollout_corr/update_ratio_max" in keys
        for key in ("loss", "grad_norm", *keys):
            assert b[key] == pytest.approx(a[key], rel=REL, abs=ABS), (step, key)
    return [full[s] for s in steps]


def _assert_dump_continued(tmp_path, steps, resumed_at):
    """The continued dump: one window per step, the resumed run's first logs.jsonl line says where it resumed, the
    interrupted run's later windows moved aside. Returns it, open."""
    from trl_rollout_corr.records import open_dump

    dump = open_dump(tmp_path / "dump")
    assert [w.logged_step for w in dump.windows] == list(steps)
    lines = (tmp_path / "dump" / "logs.jsonl").read_text().splitlines()
    assert [('"resumed_at_step": %d' % resumed_at) in line for line in lines] == [
        s == resumed_at + 1 for s in steps]
    # the resumed run recorded the rows the interrupted run had recorded for the same steps (moved aside)
    import pyarrow.parquet as pq

    aside = sorted((tmp_path / "dump" / "superseded" / f"resume-at-{resumed_at:08d}").glob("*.parquet"))
    assert len(aside) == len(steps) - resumed_at
    for old_file in aside:
        old, new = pq.read_table(old_file), pq.read_table(tmp_path / "dump" / "steps" / old_file.name)
        assert new.column_names == old.column_names
        for column in ("step", "generation_batch", "policy_version", "completion_ids", "rollout_rs_mask"):
            if column in old.column_names:  # rollout_rs_mask: decoupled mode only
                assert new.column(column).to_pylist() == old.column(column).to_pylist(), (old_file.name, column)
        for column in ("rollout_log_probs", "log_probs", "advantage"):
            assert _flat(new.column(column)) == pytest.approx(_flat(old.column(column)), rel=REL, abs=ABS)
    return dump


def _flat(column):
    values = column.to_pylist()
    return [v for row in values for v in row] if isinstance(values[0], list) else values


# ---------------------------------------------------------------------------------------------- (a) lag
def test_engine_rs_lag_split_stale_rollouts_and_max_policy_lag_resume_exactly(llama_dir, tmp_path):
    """A noisy engine synced every 3 steps (lags 0, 1, 2, 0, 1, 2), token TIS 2 + token_k1 RS on the engine factor,
    ``policy_lag_split``, ``max_policy_lag=1`` (the lag-2 steps 3 and 6 train nothing), records; checkpoint at 3 (a
    sync: the restarted engine generates step 4 with the weights the uninterrupted one took). Steps 4-6 after the
    resume are the uninterrupted run's, the lag-1 step 5 included (its pi_train@v is the weights of step 3, which
    the resumed trainer holds: it took them when it generated step 4)."""
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    args = dict(max_steps=6, save_steps=3, rollout_is="token", rollout_is_threshold="2.0", rollout_rs="token_k1",
                rollout_rs_threshold="0.8_1.25", policy_lag_split=True, rollout_rs_on="engine", max_policy_lag=1)

    def make():
        return RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=_args(tmp_path, **args),
                                      train_dataset=prompt_dataset(8), rollout_func=_NoisyEngine(3))

    first, resumed = _train_and_resume(tmp_path, make, 3)
    logs = _assert_same_steps(first, resumed, [4, 5, 6])
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0]
    assert [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs] == [0.0, 0.0, 1.0]
    # the engine factor's outliers (about 3 of 8 tokens) are rejected, the staleness of step 5 is not
    assert 0.2 < logs[1]["rollout_corr/rollout_rs_engine_masked_fraction"] < 0.5
    assert logs[1]["rollout_corr/lag_ratio_max"] != 1.0  # a real lag factor: pi_train@3 != pi_old at step 5
    dump = _assert_dump_continued(tmp_path, range(1, 7), 3)
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]


def _stop_after(step):
    """A ``TrainerCallback`` that ends training after optimizer step ``step`` (its checkpoint saved first): the
    interrupted run, with the uninterrupted run's ``max_steps`` (so the same learning-rate schedule)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = control.should_training_stop or state.global_step >= step
            return control

    return StopAfter()


def test_an_engine_kept_through_the_restart_keeps_the_lag_and_the_lag_split_resumes_exactly(llama_dir, tmp_path):
    """An engine that outlived the trainer (the same ``StaleRollout``, synced every 3 steps, last at step 0) and a
    checkpoint at 2, between syncs (docs/how-to/policy-lag.md, "Resuming from a checkpoint"), with
    ``policy_lag_split`` and ``max_policy_lag=2``. The checkpoint's feature state holds the versions the split kept at
    step 2, 0 (the initial weights, bit for bit) and 1, and the pruning bound 0; the resumed trainer scores the
    version-0 rows of step 3 at them, so steps 3 (lag 2, a real lag factor) and 4 (synced at 3: lag 0) are the
    uninterrupted run's. Resuming that checkpoint without ``policy_lag_split``, or from a copy of it without the
    feature-state file, is refused before any generation, naming the fix."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    common = dict(save_steps=2, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.5",
                  max_policy_lag=2, rollout_dump_dir=None)

    def make(path, engine, split=True):
        return RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                      args=_args(path, max_steps=4, policy_lag_split=split, **common),
                                      rollout_func=engine)

    full = make(tmp_path / "full", StaleRollout(3))
    full.train()
    kept = StaleRollout(3)
    crashed = make(tmp_path / "part", kept)
    crashed.add_callback(_stop_after(2))  # the interrupted run: stops after saving checkpoint-2
    crashed.train()
    assert crashed.state.global_step == 2 and kept.engine_version == 0
    checkpoint = tmp_path / "part" / "out" / "checkpoint-2"
    saved = torch.load(checkpoint / "rollout_corr_features.rank-00000.pt", weights_only=True)
    assert saved["features"] == ["behaviour_log_probs", "policy_lag", "support_matching", "lag_split"]
    assert saved["global_step"] == 2 and saved["world_size"] == 1
    split = saved["state"]["lag_split"]
    assert sorted(split["weights"]) == [0, 1] and split["oldest"] == 0
    initial = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    assert all(torch.equal(split["weights"][0][name], initial[name]) for name in initial)
    assert not all(torch.equal(split["weights"][1][name], initial[name]) for name in initial)  # trained at step 1

    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(checkpoint, bare)
    (bare / "rollout_corr_features.rank-00000.pt").unlink()
    other = StaleRollout(3)  # a second engine kept through a restart (the first one's state must stay untouched)
    second = make(tmp_path / "second", other)
    second.add_callback(_stop_after(2))
    second.train()
    # no feature state (plain TRL's checkpoint, an older version's): the split starts fresh, holding only the
    # resumed weights, and refuses the kept engine's rows of version 0 instead of scoring them at the wrong weights
    with pytest.raises(ValueError, match=r"rows of version 0 arrived, but the trainer holds no weights of that "
                                         r"version \(held: \[2\]\)"):
        make(tmp_path / "second", other).train(resume_from_checkpoint=str(bare))

    resumed = make(tmp_path / "part", kept)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    logs = _assert_same_steps(full, resumed, [3, 4])
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [2.0, 0.0]
    assert logs[0]["rollout_corr/lag_ratio_max"] != 1.0  # a real lag factor: pi_train@0 != pi_old at step 3
    assert logs[1]["rollout_corr/lag_ratio_max"] == 1.0  # lag 0: pi_train@3 is pi_old
    assert kept.calls[-2:] == [(2, 0), (3, 3)] == full.rollout_func.calls[-2:]
    assert sorted(resumed.rollout_corr_features.items[-1].weights) == [3]  # versions 0-2 pruned after step 4


# ---------------------------------------------------------------------------------------------- (b) M2PO
def test_m2po_with_the_pi_old_elision_resumes_exactly_and_analyze_refuses_its_dump(llama_dir, tmp_path, capsys):
    """M2PO alone (tau 2e-5 against a bf16 rollout copy: it masks tokens every step), pi_old read from the loss
    forward (the elision), records; checkpoint at 2: steps 3 and 4 after the resume are the uninterrupted run's.
    ``trl-rollout-corr analyze`` refuses the dump, naming M2PO, why, and what it can analyse."""
    from conftest import _make_trainer
    from trl_rollout_corr.cli import EXIT_BAD_INPUT, main

    def make():
        return _make_trainer(llama_dir, tmp_path, max_steps=4, save_strategy="steps", save_steps=2,
                             rollout_dump_dir=str(tmp_path / "dump"), rollout_m2_threshold=2e-5,
                             rollout_generate_dtype="bfloat16", loss_type="grpo",
                             learning_rate=1e-4)

    first, resumed = _train_and_resume(tmp_path, make, 2)
    assert resumed.rollout_corr_old_forward_plan.from_loss  # the elision is on
    logs = _assert_same_steps(first, resumed, [3, 4])
    for log in logs:
        assert 0.0 < log["rollout_corr/m2po_masked_fraction"] < 1.0
        assert log["rollout_corr/m2po_second_moment_after"] <= 2e-5 < log["rollout_corr/m2po_second_moment_before"]
    dump = _assert_dump_continued(tmp_path, range(1, 5), 2)
    # the records keep the mask trained with (what the refusal below points to): M2PO's masked tokens are the
    # valid tokens out of rollout_rs_mask (no RS configured)
    for window, log in zip(dump.windows[2:], logs):
        rows = dump.read_table([window])
        valid = sum(sum(m) for m in rows.column("completion_mask").to_pylist())
        kept = sum(sum(m) for m in rows.column("rollout_rs_mask").to_pylist())
        assert (valid - kept) / valid == pytest.approx(log["rollout_corr/m2po_masked_fraction"], abs=1e-12)
    (tmp_path / "plain.yaml").write_text("rollout_rs: seq_mean_k3\nrollout_rs_threshold: 0.01\n")
    code = main(["analyze", str(tmp_path / "dump"), "--config", str(tmp_path / "plain.yaml"),
                 "--out", str(tmp_path / "report"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert "(the run's training config): rollout_m2_threshold=2e-05 (M2PO): analyze does not recompute the " \
           "step-global M2PO mask" in err
    assert "open_dump" in err  # the fix for a dump trained with it: read its records yourself
    assert not (tmp_path / "report").exists()


# ---------------------------------------------------------------------------------------------- (c) KPop
def test_kpop_in_bypass_mode_resumes_exactly(llama_dir, tmp_path):
    """KPop RS (token_binary_kl, phi 1e-5) in bypass PPO-clip against a bf16 rollout copy, records; checkpoint at 2:
    steps 3 and 4 after the resume are the uninterrupted run's, and analyze reproduces the continued dump."""
    from conftest import _make_trainer
    from trl_rollout_corr.analyze import analyse_dump

    def make():
        return _make_trainer(llama_dir, tmp_path, max_steps=4, save_strategy="steps", save_steps=2,
                             rollout_dump_dir=str(tmp_path / "dump"), rollout_corr_preset="bypass_ppo_clip_kpop_rs",
                             rollout_rs_threshold="0.00001", rollout_generate_dtype="bfloat16",
                             learning_rate=1e-4)

    first, resumed = _train_and_resume(tmp_path, make, 2)
    assert resumed.rollout_correction.bypass_mode and resumed.rollout_correction.rollout_rs == "token_binary_kl"
    logs = _assert_same_steps(first, resumed, [3, 4])
    assert any(log["rollout_corr/rollout_rs_masked_fraction"] > 0 for log in logs)
    dump = _assert_dump_continued(tmp_path, range(1, 5), 2)
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]


# ---------------------------------------------------------------------------------------------- (d) windows
class _CrashAt(Exception):
    pass


def _crash_after_saving(step):
    """A ``TrainerCallback`` that kills training right after ``checkpoint-<step>`` was saved (and the records'
    ``on_save`` ran: callbacks run in the order added), as a crash would: no closing log."""
    from transformers import TrainerCallback

    class CrashAfterSaving(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise _CrashAt(step)

    return CrashAfterSaving()


def _assert_same_rows(dump, expected):
    """Every row of ``dump`` equals ``expected``'s, column by column (integers exactly, floats to REL/ABS), but the
    generation wall-clock times."""
    import pyarrow as pa

    a, b = dump.read_table(), expected.read_table()
    assert a.column_names == b.column_names and a.num_rows == b.num_rows
    for name in a.column_names:
        if name in ("generation_start_time", "generation_end_time"):
            continue
        kind = a.schema.field(name).type
        if pa.types.is_floating(kind) or (pa.types.is_list(kind) and pa.types.is_floating(kind.value_type)):
            assert _flat(a.column(name)) == pytest.approx(_flat(b.column(name)), rel=REL, abs=ABS, nan_ok=True), name
        else:
            assert a.column(name).to_pylist() == b.column(name).to_pylist(), name


@pytest.mark.parametrize("died", ["right_after_the_checkpoint", "after_the_window"])
def test_a_checkpoint_inside_a_logging_window_resumes_to_the_uninterrupted_records(llama_dir, tmp_path, died):
    """logging_steps 2, save_steps 3, max_steps 4: checkpoint-3 falls inside the window of steps 3..4. The
    interrupted run crashes right after saving it (step 3's rows only in ``open-window/``) or runs to the end (window
    4 written). Resumed from checkpoint-3, the dump's windows and rows are the uninterrupted run's: window 4 holds the
    rows of step 3 (taken back) and step 4 (trained again); its logged values are the resumed run's step 4 only
    (``logged_first_step`` 4), and analyze reproduces them."""
    import pyarrow.parquet as pq

    from conftest import _make_trainer
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    def make(path):
        return _make_trainer(llama_dir, path, max_steps=4, logging_steps=2, save_strategy="steps", save_steps=3,
                             rollout_dump_dir=str(path / "dump"), rollout_corr_preset="decoupled_k3_rs_token_tis")

    full = make(tmp_path / "full")
    full.train()
    part = tmp_path / ("part" if died == "right_after_the_checkpoint" else "full")
    if died == "right_after_the_checkpoint":
        crashed = make(part)
        crashed.add_callback(_crash_after_saving(3))
        with pytest.raises(_CrashAt):
            crashed.train()
        open_window = pq.read_table(part / "dump" / "open-window" / "checkpoint-00000003.rank-00000.parquet")
        assert set(open_window.column("step").to_pylist()) == {2}  # update 3 (learner step 2 at use)
        expected = open_dump(tmp_path / "full" / "dump")
    else:  # the uninterrupted run is the interrupted one: its dump, copied before the resume moves window 4
        import shutil

        shutil.copytree(part / "dump", tmp_path / "expected")
        expected = open_dump(tmp_path / "expected")
    rows_per_step = expected.read_table().num_rows // 4
    assert rows_per_step == 4 and [(w.logged_step, w.first_step) for w in expected.windows] == [(2, 1), (4, 3)]
    resumed = make(part)
    resumed.train(resume_from_checkpoint=str(part / "out" / "checkpoint-3"))
    dump = open_dump(part / "dump")
    assert [(w.logged_step, w.first_step, w.logged_first_step) for w in dump.windows] == [(2, 1, 1), (4, 3, 4)]
    window_4 = dump.read_table(dump.windows[1:])
    assert window_4.column("step").to_pylist() == [2] * rows_per_step + [3] * rows_per_step
    _assert_same_rows(dump, expected)
    assert not (part / "dump" / "open-window" / "checkpoint-00000003.rank-00000.parquet").exists()
    logged = {h["step"]: h for h in resumed.state.log_history if "loss" in h}
    assert dump.windows[1].metrics["rollout_corr/kl"] == logged[4]["rollout_corr/kl"]
    report = json.loads((part / "dump" / "superseded" / "resume-at-00000003" / "resume.rank-00000.json").read_text())
    assert report["restored_rows"] == rows_per_step
    if died == "right_after_the_checkpoint":
        assert report["superseded_rows"] == 0 and report["moved"] == []
        assert report["restored_from"] == "open-window/checkpoint-00000003.rank-00000.parquet"
    else:  # the interrupted run's window 4 moved aside whole; its step-4 rows superseded, its step-3 rows restored
        assert report["superseded_rows"] == rows_per_step
        assert report["restored_from"] == "superseded/resume-at-00000003/step-00000004.rank-00000.parquet"
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]


# ---------------------------------------------------------------------------------------------- (e) num_iterations
def test_two_iterations_with_the_pi_old_elision_resume_exactly_at_a_generation_and_regenerate_inside_one(
        llama_dir, tmp_path):
    """``num_iterations=2`` with pi_old read from the first iteration's loss forward (the elision; TRL trains each
    generation batch at two optimizer steps). Resumed at checkpoint-2 (a generation boundary), steps 3 and 4 are the
    uninterrupted run's and so is the dump. Resumed at checkpoint-3 (between a batch's two iterations), TRL keeps no
    generation batch in the checkpoint (``_buffered_inputs`` is None) and generates a new one at step 4: its rows are
    a new generation batch (generation_step 3, not the uninterrupted run's second use of batch 1), trained at its
    first iteration, where the elided pi_old makes the update ratio exactly 1; analyze reproduces both dumps."""
    from conftest import _make_trainer
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    def make(path, save_steps):
        return _make_trainer(llama_dir, path, max_steps=4, save_strategy="steps", save_steps=save_steps,
                             num_iterations=2, rollout_dump_dir=str(path / "dump"),
                             rollout_corr_preset="decoupled_k3_rs_token_tis")

    first, resumed = _train_and_resume(tmp_path, lambda: make(tmp_path, 2), 2)
    assert resumed.rollout_corr_old_forward_plan.from_loss  # the elision is on
    logs = _assert_same_steps(first, resumed, [3, 4], generated=[3])
    assert [log["rollout_corr/update_ratio_max"] == 1.0 for log in logs] == [True, False]  # iterations 1, 2
    dump = _assert_dump_continued(tmp_path, range(1, 5), 2)
    rows = dump.read_table()
    assert sorted(set(zip(rows.column("step").to_pylist(), rows.column("generation_batch").to_pylist(),
                          rows.column("generation_step").to_pylist()))) == [(0, 0, 0), (1, 0, 0), (2, 1, 2),
                                                                             (3, 1, 2)]
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]

    inside = tmp_path / "inside"
    full = make(inside, 3)
    full.train()
    again = make(inside, 3)
    again.train(resume_from_checkpoint=str(inside / "out" / "checkpoint-3"))
    assert again.state.global_step == 4
    step_4 = {h["step"]: h for h in again.state.log_history if "loss" in h}[4]
    assert step_4["rollout_corr/update_ratio_max"] == 1.0  # a first iteration: pi_theta / pi_old(elided) = 1
    assert {h["step"]: h for h in full.state.log_history if "loss" in h}[4]["rollout_corr/update_ratio_max"] != 1.0
    dump = open_dump(inside / "dump")
    rows = dump.read_table(dump.windows[3:])
    assert set(zip(rows.column("step").to_pylist(), rows.column("generation_batch").to_pylist(),
                   rows.column("generation_step").to_pylist())) == {(3, 2, 3)}  # new batch 2, generated at step 4
    old = open_dump(inside / "dump").read_table(dump.windows[:3])
    assert sorted(set(old.column("generation_batch").to_pylist())) == [0, 1]
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]


def test_two_crashes_inside_one_logging_window_with_save_total_limit_resume_to_the_uninterrupted_records(
        llama_dir, tmp_path):
    """logging_steps 4, save_steps 1, save_total_limit 1, max_steps 4: the run crashes right after checkpoint-2, its
    resumption right after checkpoint-3 (checkpoint-2 rotated away), and a second resumption from checkpoint-3
    finishes. The one window 1..4 holds every step once, row for row the uninterrupted run's; its logged values are
    the last run's (step 4 only: ``logged_first_step`` 4), which analyze reproduces, and its total counts all 4 steps.
    Each resume's report counts what it took back: 2 steps from checkpoint-2's file, then 3 from checkpoint-3's."""
    from conftest import _make_trainer
    from trl_rollout_corr.analyze import NamedConfig, Recomputer, analyse_dump, summary_row
    from trl_rollout_corr.records import open_dump

    def make(path):
        return _make_trainer(llama_dir, path, max_steps=4, logging_steps=4, save_strategy="steps", save_steps=1,
                             save_total_limit=1, rollout_dump_dir=str(path / "dump"),
                             rollout_corr_preset="decoupled_k3_rs_token_tis")

    full = make(tmp_path / "full")
    full.train()
    expected = open_dump(tmp_path / "full" / "dump")
    part = tmp_path / "part"
    crashed = make(part)
    crashed.add_callback(_crash_after_saving(2))
    with pytest.raises(_CrashAt):
        crashed.train()
    again = make(part)
    again.add_callback(_crash_after_saving(3))
    with pytest.raises(_CrashAt):
        again.train(resume_from_checkpoint=str(part / "out" / "checkpoint-2"))
    assert sorted(p.name for p in (part / "out").iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    assert sorted(p.name for p in (part / "dump" / "open-window").iterdir()) == [
        "checkpoint-00000003.rank-00000.parquet"]
    resumed = make(part)
    resumed.train(resume_from_checkpoint=True)  # the latest: checkpoint-3
    dump = open_dump(part / "dump")
    assert [(w.logged_step, w.first_step, w.logged_first_step) for w in dump.windows] == [(4, 1, 4)]
    _assert_same_rows(dump, expected)
    assert not list((part / "dump" / "open-window").iterdir())
    rows_per_step = expected.read_table().num_rows // 4
    reports = [json.loads((part / "dump" / "superseded" / f"resume-at-0000000{k}" / "resume.rank-00000.json")
                          .read_text()) for k in (2, 3)]
    assert [(r["restored_rows"], r["superseded_rows"], r["restored_from"]) for r in reports] == [
        (2 * rows_per_step, 0, "open-window/checkpoint-00000002.rank-00000.parquet"),
        (3 * rows_per_step, 0, "open-window/checkpoint-00000003.rank-00000.parquet")]
    logged = {h["step"]: h for h in resumed.state.log_history if "loss" in h}
    assert dump.windows[0].metrics["rollout_corr/kl"] == logged[4]["rollout_corr/kl"]
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped and not check.not_recomputed, check.failures[:5]
    named = NamedConfig("trained", dump.correction_config())
    totals = [summary_row(Recomputer(d).analyse(named, d.length_buckets).total) for d in (dump, expected)]
    assert totals[0]["valid_rows"] == 4 * rows_per_step
    assert totals[0] == pytest.approx(totals[1], rel=REL, abs=ABS)


# ---------------------------------------------------------------------------------------------- (f) feature state
def test_support_matching_off_measures_the_kept_mass_once_across_a_resume(llama_dir, tmp_path, caplog):
    """top_p 0.8 with matching off: the kept mass is measured once, at the first training batch, and warned at its
    log. The checkpoint at 1 saves both as done (``SupportMatching.state_dict``), so steps 2 and 3 after the resume
    are the uninterrupted run's: no second measurement (no ``support_*`` keys), no second warning."""
    import logging

    import torch

    from conftest import _make_trainer

    def make():
        return _make_trainer(llama_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=1, top_p=0.8,
                             rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.5")

    first = make()
    first.train()
    step_1 = {h["step"]: h for h in first.state.log_history if "loss" in h}[1]
    assert step_1["rollout_corr/support_log_mass_mean"] < -1e-3  # measured at step 1
    saved = torch.load(tmp_path / "out" / "checkpoint-1" / "rollout_corr_features.rank-00000.pt", weights_only=True)
    assert saved["state"]["support_matching"] == {"measure_due": False, "warn_due": False,
                                                  "processors_warned": False}
    resumed = make()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.trainer"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    logs = _assert_same_steps(first, resumed, [2, 3])
    assert all(log["grad_norm"] > 0 for log in logs)  # trained
    assert not any(key.startswith("rollout_corr/support_") for log in logs for key in log)
    assert not [r for r in caplog.records if "Measured mean log kept mass" in r.getMessage()]


def test_dump_every_2_resumes_to_the_uninterrupted_records(llama_dir, tmp_path):
    """``rollout_dump_every=2``, a window per step, checkpoint at 2: the dump keeps windows 1 and 3; window 2's rows
    are in no file. Resumed from checkpoint-2, window 3's rows are the uninterrupted run's, their micro-step and
    generation-batch numbers included: one micro-batch and one generation batch per step, so 2 and 2 (they count the
    skipped window's), restored from the checkpoint's counts (a count of the dump's kept files gives 1 and 1)."""
    import torch

    from conftest import _make_trainer
    from trl_rollout_corr.records import open_dump

    def make(path):
        return _make_trainer(llama_dir, path, max_steps=3, save_strategy="steps", save_steps=2,
                             rollout_dump_dir=str(path / "dump"), rollout_dump_every=2,
                             rollout_corr_preset="decoupled_k3_rs_token_tis")

    full = make(tmp_path / "full")
    full.train()
    crashed = make(tmp_path / "part")
    crashed.add_callback(_stop_after(2))
    crashed.train()
    saved = torch.load(tmp_path / "part" / "out" / "checkpoint-2" / "rollout_corr_features.rank-00000.pt",
                       weights_only=True)["state"]["rollout_records"]
    assert saved["batches"] == 2 and saved["writer"]["micro_step"] == 2 and saved["writer"]["windows"] == 2
    resumed = make(tmp_path / "part")
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "out" / "checkpoint-2"))
    _assert_same_steps(full, resumed, [3])
    dump, expected = open_dump(tmp_path / "part" / "dump"), open_dump(tmp_path / "full" / "dump")
    assert [(w.logged_step, w.dumped) for w in dump.windows] == [(1, True), (2, False), (3, True)]
    window_3 = dump.read_table(dump.windows[2:])
    assert window_3.num_rows == 4
    assert set(window_3.column("micro_step").to_pylist()) == {2}
    assert set(window_3.column("generation_batch").to_pylist()) == {2}
    _assert_same_rows(dump, expected)


@pytest.mark.slow
def test_two_ranks_push_both_feature_files_with_each_checkpoint(llama_dir, tmp_path):
    """2 ranks (torchrun + gloo, real DDP), ``hub_strategy="checkpoint"``, a checkpoint every step, rank 1 writing
    its state file 2 s late: each pushed ``last-checkpoint`` holds BOTH ranks' feature files of its own step (the
    main process uploads only after every rank wrote: ``checkpoint_state.save_before_push``), each rank writes its
    file once per checkpoint, and only rank 0 uploads."""
    import os
    import socket
    import sys
    from pathlib import Path

    from torchrun import run_torchrun

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(Path(__file__).resolve().parents[1] / "helpers" / "dist_push_worker.py"), str(out), str(llama_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = run_torchrun(cmd, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["writes"] for r in ranks] == [["checkpoint-1", "checkpoint-2"]] * 2
    assert ranks[1]["uploads"] == []
    pushed = [u for u in ranks[0]["uploads"] if u["path_in_repo"] == "last-checkpoint"]
    files = ["rollout_corr_features.rank-00000.pt", "rollout_corr_features.rank-00001.pt"]
    assert [(u["message"], u["files"], u["steps"]) for u in pushed] == [
        ("Training in progress, step 1, checkpoint", files, [1, 1]),
        ("Training in progress, step 2, checkpoint", files, [2, 2])]
