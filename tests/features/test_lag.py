"""Policy versions and lag (spec section 7): ``lag.py`` by hand, and through the trainer with a stale engine
(``stale_rollout.StaleRollout``): every row's version and lag at the loss against what really generated it, for a
sync interval, ``num_iterations`` and an asynchronous depth; the ``max_policy_lag`` filter; the three-way split;
bad versions."""

from __future__ import annotations

import math

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.lag import (
    WeightSchedule,
    drop_stale_rows,
    lag_counts,
    lag_keep,
    masked_lag_max,
    policy_lag,
    row_versions,
)
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer


# ---------------------------------------------------------------------------------------------- lag.py
def test_row_versions_checks_and_per_token_minimum():
    assert row_versions([3, [4, 2, 5], 0], 3, current_step=5).tolist() == [3, 2, 0]
    assert row_versions(None, 2, current_step=7).tolist() == [7, 7]
    with pytest.raises(ValueError, match="row 1 reaches 6, ahead of the trainer's optimizer step 5"):
        row_versions([5, 6], 2, current_step=5)
    # a per-token version from the future is refused too, though the row's own (oldest) version is not ahead
    with pytest.raises(ValueError, match="row 0 reaches 5, ahead of the trainer's optimizer step 4"):
        row_versions([[3, 5]], 1, current_step=4, completion_lengths=[2])
    assert row_versions([[3, 4]], 1, current_step=4, completion_lengths=[2]).tolist() == [3]
    with pytest.raises(ValueError, match="max_policy_lag is set but the rollout_func returned no 'policy_version'"):
        row_versions(None, 2, current_step=1, required=True)
    with pytest.raises(ValueError, match="3 entries for 2 rows"):
        row_versions([0, 0, 0], 2, current_step=1)
    with pytest.raises(ValueError, match="bool"):
        row_versions([True], 1, current_step=1)
    with pytest.raises(ValueError, match="empty per-token list"):
        row_versions([[]], 1, current_step=1)
    with pytest.raises(ValueError, match=">= 0"):
        row_versions([-1], 1, current_step=1)


def test_row_versions_take_numpy_and_tensor_integers_and_refuse_strings_and_bad_lengths():
    """Issue 22: a NumPy integer was refused ("give an int"), the string "10" became version 0 (its characters
    parsed as the per-token versions 1 and 0), and a per-token list of another length than the completion was
    accepted."""
    np = pytest.importorskip("numpy")
    versions = row_versions([np.int64(3), np.array([4, 2, 5]), torch.tensor(1), torch.tensor([2, 2])], 4,
                            current_step=5, completion_lengths=[1, 3, 7, 2])
    assert versions.tolist() == [3, 2, 1, 2] and versions.dtype == torch.int64
    with pytest.raises(ValueError, match="row 0 is the string '10', not a step"):
        row_versions(["10"], 1, current_step=12)
    with pytest.raises(ValueError, match="row 1 has 2 per-token versions for its 3 completion tokens"):
        row_versions([0, [0, 0]], 2, current_step=1, completion_lengths=[1, 3])
    with pytest.raises(ValueError, match="row 0 has 4 per-token versions for its 3 completion tokens"):
        row_versions([[0, 0, 0, 0]], 1, current_step=1, completion_lengths=[3])
    with pytest.raises(ValueError, match="row 0, token 1, is 1.5"):
        row_versions([[1, 1.5]], 1, current_step=2)
    with pytest.raises(ValueError, match="row 0 is 2.0; give the optimizer step as an int"):
        row_versions([2.0], 1, current_step=2)
    for flag in (np.bool_(True), torch.tensor(True)):
        with pytest.raises(ValueError, match="row 0"):
            row_versions([flag], 1, current_step=2)


def test_lag_counts_by_hand():
    lags = policy_lag(torch.tensor([5, 4, 1, 0, 5]), current_step=5)  # [0, 1, 4, 5, 0]
    tokens = torch.tensor([2, 3, 1, 4, 0])  # the last row's tokens are all masked: a used row without tokens
    keep = lag_keep(lags, 1)
    assert lags.tolist() == [0, 1, 4, 5, 0] and keep.tolist() == [True, True, False, False, True]
    c = {k: (int(n), int(d)) for k, (n, d) in lag_counts(lags, tokens, keep).items()}
    assert c["policy_lag_mean"] == (0 + 1 + 4 + 5 + 0, 5)
    assert c["policy_lag_token_mean"] == (0 * 2 + 1 * 3 + 4 * 1 + 5 * 4, 10)
    assert c["policy_lag_fraction_0"] == (2, 5) and c["policy_lag_fraction_1"] == (1, 5)
    assert c["policy_lag_fraction_4_7"] == (2, 5) and c["policy_lag_fraction_8_plus"] == (0, 5)
    assert c["policy_lag_dropped_fraction"] == (2, 5) and c["policy_lag_dropped_token_fraction"] == (5, 10)
    assert int(masked_lag_max(lags)) == 5
    assert int(masked_lag_max(torch.zeros(0, dtype=torch.long))) == -1
    assert lag_keep(lags, None).all()


def test_drop_stale_rows_by_hand():
    completion = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    tool = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 1]])
    batch = {"rollout_policy_version": torch.tensor([3, 1, 2]), "completion_mask": completion, "tool_mask": tool}
    loss_mask = completion * tool
    # step 3, bound 1: lags [0, 2, 1], the middle row over it
    out, keep = drop_stale_rows(batch, loss_mask, 3, 1)
    assert keep.tolist() == [True, False, True]
    assert out["tool_mask"].tolist() == [[1, 0, 0], [0, 0, 0], [1, 0, 0]]  # bypass: the loss mask, stale row out
    assert batch["tool_mask"] is tool and out["completion_mask"] is completion  # a copy; TRL's keys untouched
    # decoupled: the RS mask carries the drop, TRL's tool mask stays
    rs = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
    out, _ = drop_stale_rows({**batch, "rollout_rs_mask": rs}, loss_mask, 3, 1)
    assert out["rollout_rs_mask"].tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]] and out["tool_mask"] is tool
    # every row kept, no bound, no versions: the batch itself
    same, keep = drop_stale_rows(batch, loss_mask, 3, 2)
    assert same is batch and keep.tolist() == [True, True, True]
    assert drop_stale_rows(batch, loss_mask, 3, None) == (batch, None)
    no_versions = {"completion_mask": completion}
    assert drop_stale_rows(no_versions, completion, 3, 0) == (no_versions, None)


def test_weight_schedule():
    sync3 = WeightSchedule(sync_interval=3)
    held, seen = None, []
    for step in range(8):
        if sync3.needs_sync(step, held):
            held = step
        seen.append(held)
    assert seen == [0, 0, 0, 3, 3, 3, 6, 6]
    async2 = WeightSchedule(async_depth=2)
    assert [async2.async_version(s, list(range(s + 1))) for s in range(5)] == [0, 0, 0, 1, 2]
    assert async2.async_version(6, [2, 4, 6]) == 4  # published every other step: the newest at least 2 old
    for bad in (dict(sync_interval=0), dict(async_depth=-1), dict(sync_interval=2, async_depth=1),
                dict(sync_interval=True)):
        with pytest.raises(ValueError):
            WeightSchedule(**bad)


# ---------------------------------------------------------------------------------------------- through the trainer
class _LossSpy(RolloutCorrGRPOTrainer):
    """Records, for every micro-batch reaching the loss: the optimizer step, each row's version as carried in the
    batch, its (prompt, completion) ids, and the row's loss mask after the lag filter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _compute_loss(self, model, inputs):
        out = super()._compute_loss(model, inputs)
        rows = []
        for i in range(inputs["completion_ids"].size(0)):
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            n = int(inputs["completion_mask"][i].sum())
            rows.append((tuple(prompt), tuple(inputs["completion_ids"][i][:n].tolist())))
        self.seen.append((self.state.global_step, inputs["rollout_policy_version"].tolist(), rows))
        return out


def _train(llama_dir, tmp_path, rollout, trainer_cls=_LossSpy, **overrides):
    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 6, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "learning_rate": 1e-3, "save_strategy": "no", "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False,
        "rollout_corr_preset": "decoupled_token_is", **overrides})
    trainer = trainer_cls(model=llama_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset(8),
                          rollout_func=rollout)
    trainer.train()
    return trainer


def _check_every_row(trainer, rollout):
    """Every row that reached the loss carries the version that really generated it; returns the per-step lags."""
    lags_by_step, checked = {}, 0
    for step, versions, rows in trainer.seen:
        for version, (prompt, completion) in zip(versions, rows):
            truth = rollout.true_version(prompt, completion)
            if truth is not None:
                assert version == truth, (step, prompt, completion)
                checked += 1
        lags_by_step.setdefault(step, []).extend(step - v for v in versions)
    assert checked >= 0.9 * sum(len(v) for _, v, _ in trainer.seen)
    return lags_by_step


@pytest.mark.parametrize("case", ["sync3_iters2", "async2"])
def test_every_sample_reaches_the_loss_with_its_exact_lag(llama_dir, tmp_path, monkeypatch, case):
    """Sync interval 3 with num_iterations 2, and async depth 2: each row's version in the loss is the version
    that generated it, and the logged rollout_corr/policy_lag_* are exactly those rows' lags."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    if case == "sync3_iters2":
        rollout, overrides = StaleRollout(sync_interval=3), dict(num_iterations=2)
        # generation at steps 0, 2, 4 (num_iterations 2); syncs at 0 and 4 (3 steps after 0 is step 3: no call)
        expected = {0: [0], 1: [1], 2: [2], 3: [3], 4: [0], 5: [1]}
    else:
        rollout, overrides = StaleRollout(async_depth=2), {}
        expected = {0: [0], 1: [1], 2: [2], 3: [2], 4: [2], 5: [2]}
    trainer = _train(llama_dir, tmp_path, rollout, **overrides)
    lags = _check_every_row(trainer, rollout)
    assert {step: sorted(set(v)) for step, v in lags.items()} == expected
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for log in logs:
        step_lags = lags[log["step"] - 1]  # the log after optimizer step k describes the update made at step k - 1
        assert log["rollout_corr/policy_lag_mean"] == pytest.approx(sum(step_lags) / len(step_lags), abs=1e-12)
        assert log["rollout_corr/policy_lag_max"] == max(step_lags)
        assert log["rollout_corr/policy_lag_fraction_2_3"] == pytest.approx(
            sum(2 <= x <= 3 for x in step_lags) / len(step_lags), abs=1e-12)


def test_max_policy_lag_drops_stale_rows_from_loss_and_baseline(llama_dir, tmp_path, monkeypatch):
    """Sync interval 3, max_policy_lag 1: rows of lag 2 have no loss token and advantage 0, counted exactly."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []

    class Spy(_LossSpy):
        def _compute_loss(self, model, inputs):  # after the loss: pi_old elided, the correction runs in it
            loss = super()._compute_loss(model, inputs)
            seen.append((self.state.global_step, inputs["rollout_policy_version"].clone(),
                         inputs["advantages"].clone(), inputs["rollout_rs_mask"].clone()))
            return loss

    rollout = StaleRollout(sync_interval=3)
    trainer = _train(llama_dir, tmp_path, rollout, trainer_cls=Spy, max_steps=4, max_policy_lag=1)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs] == [0.0, 0.0, 1.0, 0.0]
    for step, versions, advantages, rs_mask in seen:
        stale = (step - versions) > 1
        assert (advantages[stale] == 0).all() and (rs_mask[stale].sum() == 0)
    assert any(bool(((step - v) > 1).any()) for step, v, _, _ in seen)


def test_bad_versions_name_the_fix(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    with pytest.raises(ValueError, match="ahead of the trainer's optimizer step 0"):
        _train(llama_dir, tmp_path / "future", StaleRollout(report="future"), max_steps=1)
    with pytest.raises(ValueError, match="Return 'policy_version'"):
        _train(llama_dir, tmp_path / "none", StaleRollout(report="none"), max_steps=1, max_policy_lag=2)
    with pytest.raises(ValueError, match=r"row 0 has \d+ per-token versions for its \d+ completion tokens"):
        _train(llama_dir, tmp_path / "short", StaleRollout(report="per_token_short"), max_steps=1)
    with pytest.raises(ValueError, match="max_policy_lag must be an int >= 0"):
        RolloutCorrGRPOConfig(str(tmp_path), rollout_corr_preset="decoupled_token_is", max_policy_lag=-1,
                              bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="configure a rollout correction"):
        RolloutCorrGRPOConfig(str(tmp_path), max_policy_lag=2, bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="policy_lag_split needs pi_old"):
        RolloutCorrGRPOConfig(str(tmp_path), rollout_corr_preset="bypass_pg_is", policy_lag_split=True,
                              bf16=False, use_cpu=True)


def test_per_token_versions_take_the_oldest(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = StaleRollout(sync_interval=2, report="per_token")
    trainer = _train(llama_dir, tmp_path, rollout, max_steps=3)
    assert [sorted(set(v)) for _, v, _ in trainer.seen] == [[0], [0], [2]]


def test_lag_split_is_exact_at_lag_zero(llama_dir, tmp_path, monkeypatch):
    """Lag 0: the lag ratio is exactly 1 and the engine ratio equals the run without the split, bit for bit."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runs = {}
    for split in (False, True):
        trainer = _train(llama_dir, tmp_path / str(split), StaleRollout(), max_steps=3, policy_lag_split=split)
        runs[split] = [h for h in trainer.state.log_history if "loss" in h]
        if split:
            assert trainer.rollout_corr_forward_counts["version_log_probs"] == 0
    keys = [f"rollout_corr/engine_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]
    for plain, split in zip(runs[False], runs[True]):
        assert [split[k] for k in keys] == [plain[k] for k in keys]
        assert all(split[f"rollout_corr/lag_ratio_{q}"] == 1.0 for q in ("mean", "p01", "p50", "p99", "max"))


def test_lag_split_puts_the_gap_in_the_lag_ratio(llama_dir, tmp_path, monkeypatch):
    """Sync interval 3, float32 engine and trainer: the engine ratio pi_train@v / mu is 1 to 1e-5 and the lag
    ratio pi_old / pi_train@v carries the whole gap on the stale steps."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3), max_steps=5, policy_lag_split=True)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.rollout_corr_forward_counts["version_log_probs"] == 3  # steps 1, 2 (version 0) and 4 (version 3)
    for log in logs:
        for q in ("p01", "max"):
            assert abs(log[f"rollout_corr/engine_ratio_{q}"] - 1.0) < 1e-5
        stale = log["rollout_corr/policy_lag_mean"] > 0
        gap = max(abs(log["rollout_corr/lag_ratio_max"] - 1), abs(log["rollout_corr/lag_ratio_p01"] - 1))
        assert (gap > 1e-3) if stale else (gap == 0.0), log["step"]
        assert math.isfinite(log["rollout_corr/direct_ratio_mean"])


def test_lag_fields_are_flags(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RolloutCorrGRPOConfig).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--rollout_corr_preset", "decoupled_token_is", "--max_policy_lag", "3",
        "--policy_lag_split", "--use_cpu", "--bf16", "false"])
    assert args.max_policy_lag == 3 and args.policy_lag_split is True


def test_analyze_reproduces_the_lag_metrics_of_stale_rollouts(llama_dir, tmp_path):
    """A dump of a sync-interval-3 run: the records carry each row's policy version, and ``analyze`` recomputes
    every logged policy_lag_* value (row and token means, buckets, max) exactly."""
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    trainer = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3), max_steps=4,
                     rollout_dump_dir=str(tmp_path / "dump"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0, 0.0]
    check, _, recomputer = analyse_dump(open_dump(tmp_path / "dump"), [])
    assert check.ok and not check.not_recomputed and check.max_abs_diff <= 1e-5, check.failures[:3]
    assert recomputer.rows.has("policy_version")
    lag_keys = {k for log in logs for k in log if k.startswith("rollout_corr/policy_lag_")}
    assert {"rollout_corr/policy_lag_token_mean", "rollout_corr/policy_lag_fraction_2_3"} <= lag_keys
    # with max_policy_lag (records 1.1): step 3's rows are lag 2 > 1, dropped, and analyze reproduces the drops
    bounded = _train(llama_dir, tmp_path / "bounded", StaleRollout(sync_interval=3), max_steps=3, max_policy_lag=1,
                     rollout_dump_dir=str(tmp_path / "bounded_dump"))
    bounded_logs = [h for h in bounded.state.log_history if "loss" in h]
    assert [h["rollout_corr/policy_lag_dropped_fraction"] for h in bounded_logs] == [0.0, 0.0, 1.0]
    # the fully dropped step logs its counts but no statistic over its (no) rows: absent, never 0.0
    empty_keys = {f"rollout_corr/{n}_ratio_{q}" for n in ("engine", "update", "direct")
                  for q in ("mean", "p01", "p50", "p99", "max")}
    empty_keys |= {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/kl",
                   "rollout_corr/len_0_64/kl"}
    for log in bounded_logs[:2]:
        assert empty_keys <= set(log), log["step"]
    last = bounded_logs[2]
    assert not empty_keys & set(last) and not [k for k in last if k.startswith("rollout_corr/rollout_is")]
    assert last["rollout_corr/num_valid_tokens"] == 0 and last["rollout_corr/policy_lag_dropped_token_fraction"] == 1
    check, analyses, _ = analyse_dump(open_dump(tmp_path / "bounded_dump"), [])
    assert check.ok and not check.not_recomputed and check.max_abs_diff <= 1e-5, check.failures[:3]
    ours = analyses[0].per_window[3].metrics()  # analyze leaves out the same keys for that step
    assert set(ours) == {k for k in last if k.startswith("rollout_corr/")}
