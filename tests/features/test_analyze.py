"""Offline what-if analysis (analyze/): hand-computed what-if values on a hand-made dump, the check against the
logged values (it passes on real dumps of every mode, to 1e-5, and fails on a tampered value), and config input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hand_dump import LN, hand_dump
from torchrun import run_torchrun
from trl_rollout_corr.analyze import (
    ConfigError,
    NamedConfig,
    analyse_dump,
    length_slices,
    preset_config,
    summary_row,
    yaml_config,
)
from trl_rollout_corr.config import RolloutCorrectionConfig
from trl_rollout_corr.correction import compute_rollout_correction
from trl_rollout_corr.records import open_dump


# ---------------------------------------------------------------------------------------------- hand-computed
@pytest.mark.unit
def test_what_if_values_by_hand(tmp_path):
    dump = open_dump(hand_dump(tmp_path / "d"))
    rs_band = NamedConfig("k1 band", RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.6_2.5"))
    k3 = NamedConfig("k3", RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.2))
    check, analyses, _ = analyse_dump(dump, [rs_band, k3])
    # 57: the empty slice [0, 2) logs only its num_seqs (no kl, k3_kl, is_eff_sample_size over no token)
    assert check.ok and check.compared == 57 and check.max_abs_diff == 0.0
    trained, band, seq = (summary_row(a.total) for a in analyses)
    # token TIS at 2: W = [1, 2, 1, 0.5, 1]; Kish ESS = (sum W)^2 / (n sum W^2) = 5.5^2 / (5 * 7.25)
    assert trained["ess"] == pytest.approx(5.5**2 / (5 * 7.25), abs=1e-6)  # float32 log-probs
    assert trained["kept_tokens"] == 1.0 and trained["kept_rows"] == 1.0
    # kl = mean(log mu - log pi_old) = -(ln 3 + ln 0.5) / 5; k3 = mean(exp(x) - 1 - x)
    assert trained["kl"] == pytest.approx(-(LN(3) + LN(0.5)) / 5, abs=1e-6)
    k3_tokens = (3 - 1 - LN(3)) + (0.5 - 1 - LN(0.5))
    assert trained["k3_kl"] == pytest.approx(k3_tokens / 5, abs=1e-6)
    # k1 band [0.6, 2.5] rejects the tokens with ratio 3 and 0.5: 3 of 5 kept, both rows keep a token
    assert (band["kept_tokens"], band["kept_rows"], band["ess"]) == (0.6, 1.0, None)
    # seq_mean_k3 at 0.2: row 0's mean k3 is 0.901 / 3 = 0.30 (rejected), row 1's 0.193 / 2 = 0.097 (kept)
    assert (seq["kept_tokens"], seq["kept_rows"]) == (0.4, 0.5)
    # length slices (valid tokens per row, edges 2, 3): row 1 (2 tokens) in [2, 3), row 0 (3 tokens) in [3, inf)
    slices = {r["bucket"]: r for r in length_slices(analyses[2])}
    assert slices["[2, 3)"]["kept_rows"] == 1.0 and slices["[3, inf)"]["kept_rows"] == 0.0
    assert slices["[0, 2)"]["rows"] == 0
    assert list(analyses[0].by_lag) == [0]


@pytest.mark.unit
def test_check_fails_on_a_tampered_value_and_reports_unknown_keys(tmp_path):
    good = open_dump(hand_dump(tmp_path / "good"))
    logged = dict(good.windows[0].metrics)
    logged["rollout_corr/kl"] += 1e-3
    logged["rollout_corr/some_future_metric"] = 1.0
    check, _, _ = analyse_dump(open_dump(hand_dump(tmp_path / "bad", logged)), [])
    assert not check.ok
    assert [(step, key) for step, key, _, _ in check.failures] == [(1, "rollout_corr/kl")]
    assert check.max_abs_diff == pytest.approx(1e-3, rel=1e-6)
    assert check.not_recomputed == {"rollout_corr/some_future_metric"}


@pytest.mark.unit
def test_decoupled_config_on_a_bypass_dump_is_refused(tmp_path):
    dump = open_dump(hand_dump(tmp_path / "d"))
    dump.read_table()
    # drop old_log_probs from the file: what a bypass run writes
    import pyarrow.parquet as pq

    step_file = dump.windows[0].files[0]
    table = pq.read_table(step_file)
    pq.write_table(table.drop_columns(["old_log_probs"]).replace_schema_metadata(table.schema.metadata), step_file)
    with pytest.raises(ConfigError, match=r"needs column 'old_log_probs'.*bypass-mode run never computes pi_old"):
        analyse_dump(open_dump(tmp_path / "d"), [preset_config("decoupled_geo_rs")])


# ---------------------------------------------------------------------------------------------- configs
def _same(a: RolloutCorrectionConfig, b: RolloutCorrectionConfig) -> bool:
    """Equal in meaning (thresholds parsed: '2.0' and 2.0 are the same bound)."""
    plain = ("rollout_is", "rollout_rs", "rollout_is_batch_normalize", "bypass_mode", "bypass_loss_type")
    return (a.is_bounds, a.rs_specs) == (b.is_bounds, b.rs_specs) and all(getattr(a, k) == getattr(b, k)
                                                                          for k in plain)


@pytest.mark.unit
def test_yaml_configs(tmp_path):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"
    named = yaml_config(recipe)  # a recipe config: its correction part, the other keys are the recipe's
    assert named.label == "cpu_smollm2_decoupled"
    assert _same(named.config, RolloutCorrectionConfig.decoupled_k3_rs_token_tis())
    f = tmp_path / "mine.yaml"
    f.write_text("label: tighter\nrollout_corr_preset: decoupled_k3_rs\nrollout_rs_threshold: 0.005\n")
    named = yaml_config(f)
    assert named.label == "tighter"
    assert _same(named.config, RolloutCorrectionConfig.decoupled_k3_rs(rs_threshold=0.005))
    f.write_text("rollout_is: token\nrollout_is_threshold: 2.0\n  bad: [indent\n")
    with pytest.raises(ConfigError, match=r"mine.yaml:3:\d+: not valid YAML"):
        yaml_config(f)
    f.write_text("rollout_is: token\nrollout_is_treshold: 2.0\n")
    with pytest.raises(ConfigError, match=r"unknown key 'rollout_is_treshold'; did you mean 'rollout_is_threshold'"):
        yaml_config(f)
    f.write_text("rollout_is: token\nrollout_is_threshold: -1\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: rollout_is_threshold: the upper bound must be positive"):
        yaml_config(f)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a YAML mapping"):
        yaml_config(f)
    with pytest.raises(ConfigError, match="cannot read it"):
        yaml_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"'decoupled_token_iss' is not a preset. Did you mean 'decoupled_token_is'"):
        preset_config("decoupled_token_iss")


# ---------------------------------------------------------------------------------------------- real dumps
MODES = {
    # name: config overrides (tiny Llama, 4 steps; the same families as tests/trainer/test_trainer_modes.py)
    "decoupled_tis_accum2": dict(rollout_corr_preset="decoupled_token_is", loss_type="grpo",
                                 gradient_accumulation_steps=2),
    "decoupled_icepop_rs_reused": dict(rollout_corr_preset="decoupled_token_icepop", rollout_rs="seq_mean_k3",
                                       rollout_rs_threshold="0.5", beta=0.04, num_iterations=2),
    "decoupled_seq_bn_spg2_log2": dict(rollout_is="sequence", rollout_is_threshold="2.0",
                                       rollout_is_batch_normalize=True, rollout_rs="token_k1",
                                       rollout_rs_threshold="0.8_1.25", steps_per_generation=2, logging_steps=2,
                                       gradient_accumulation_steps=2),  # issue 9: batch norm needs whole batches
    "bypass_k3_truncated": dict(rollout_corr_preset="bypass_ppo_clip_k3_rs", rollout_rs_threshold="0.5",
                                loss_type="dr_grpo", gradient_accumulation_steps=2, mask_truncated_completions=True),
    "bypass_seq_is_spg2": dict(rollout_corr_preset="bypass_pg_is", loss_type="bnpo", steps_per_generation=2),
    "no_correction_diagnostics": dict(rollout_corr_preset="disabled"),  # TRL's GRPO; the dump feeds a what-if
}


@pytest.mark.parametrize("mode", list(MODES))
def test_analyze_reproduces_the_logged_metrics(mode, llama_dir, tmp_path, make_trainer):
    overrides = MODES[mode]
    trainer = make_trainer(llama_dir, tmp_path, max_steps=4, rollout_dump_dir=str(tmp_path / "dump"), **overrides)
    trainer.train()
    dump = open_dump(tmp_path / "dump")
    logged_steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert [w.logged_step for w in dump.windows] == logged_steps
    what_if = preset_config("bypass_pg_geo_rs" if trainer.rollout_correction.bypass_mode else "decoupled_geo_rs")
    check, analyses, recomputer = analyse_dump(dump, [what_if])
    assert check.ok, check.failures[:5]
    assert check.compared >= 17 * len(logged_steps) and check.max_abs_diff <= 1e-5  # ratios + lag at least
    assert not check.not_recomputed and not check.skipped
    # every trained use is a row: 4 steps x 4 rows per optimizer step x accumulation
    uses = 4 * 4 * overrides.get("gradient_accumulation_steps", 1)
    assert recomputer.rows.n == uses
    if trainer.rollout_correction.enabled and not trainer.rollout_correction.bypass_mode:
        # the recorded RS mask and IS weights are what the recomputation gives for the trained config
        rows = recomputer.rows
        index = torch.arange(rows.n)
        b = rows.batch(index, policy="old_log_probs")
        out = compute_rollout_correction(b["policy"], b["rollout"], b["mask"], trainer.rollout_correction)
        width = b["mask"].shape[1]
        assert torch.equal(rows.full("rollout_rs_mask", dtype=torch.int64)[:, :width], out.response_mask.long())
        if not trainer.rollout_correction.rollout_is_batch_normalize:
            recorded = rows.full("rollout_is_weights")[:, :width]
            assert torch.allclose(recorded, torch.where(b["mask"] > 0, out.weights, 0.0), atol=1e-7)
    assert [a.named.label for a in analyses] == ["trained", what_if.label]


def test_a_run_resumed_from_a_checkpoint_continues_its_dump(llama_dir, tmp_path, make_trainer):
    """Issue 22: resuming from a checkpoint with the same rollout_dump_dir was refused. The run below trains 4 steps
    (checkpoint at 2), then a second trainer resumes from checkpoint-2 into the same dump, as after a crash: the
    dump keeps one window per step (the resumed run's 3 and 4), the same run_id, and analyze reproduces it."""
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, rollout_corr_preset="decoupled_k3_rs_token_tis",
              rollout_dump_dir=str(tmp_path / "dump"))
    first = make_trainer(llama_dir, tmp_path, **kw)
    first.train()
    run_id = open_dump(tmp_path / "dump").metadata["run_id"]
    resumed = make_trainer(llama_dir, tmp_path, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    dump = open_dump(tmp_path / "dump")
    assert dump.metadata["run_id"] == run_id
    assert [(w.logged_step, w.first_step) for w in dump.windows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    logged = {h["step"]: h for h in resumed.state.log_history if "loss" in h}  # 1, 2 from the checkpoint
    assert sorted(logged) == [1, 2, 3, 4]  # 3 and 4 the resumed run's, as the dump holds them:
    for w in dump.windows[2:]:
        assert w.metrics["rollout_corr/kl"] == logged[w.logged_step]["rollout_corr/kl"]
    rows = dump.read_table(dump.windows[2:])
    assert sorted(set(rows.column("generation_batch").to_pylist())) == [2, 3]  # numbered after the kept 0, 1
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped, check.failures[:5]
    assert sorted(p.name for p in (tmp_path / "dump" / "superseded" / "resume-at-00000002").iterdir()) == [
        "logs.jsonl", "resume.rank-00000.json", "step-00000003.rank-00000.parquet", "step-00000004.rank-00000.parquet"]


def test_records_do_not_change_training_and_are_off_by_default(llama_dir, tmp_path, make_trainer):
    kw = dict(max_steps=2, rollout_corr_preset="decoupled_k3_rs_token_tis")
    plain = make_trainer(llama_dir, tmp_path / "a", **kw)
    plain.train()
    assert plain.rollout_records is None and not (tmp_path / "a" / "dump").exists()
    dumped = make_trainer(llama_dir, tmp_path / "b", rollout_dump_dir=str(tmp_path / "b" / "dump"), **kw)
    dumped.train()

    def logs(t):
        return [{k: v for k, v in h.items() if "time" not in k and "runtime" not in k and "per_second" not in k}
                for h in t.state.log_history]

    assert logs(plain) == logs(dumped)
    run = json.loads((tmp_path / "b" / "dump" / "run.json").read_text())
    assert run["correction"]["rollout_corr_preset"] == "decoupled_k3_rs_token_tis"
    assert run["engine"]["rollout_engine"] == "transformers.generate"
    assert run["sampling"]["max_completion_length"] == 8 and run["rewards"]["names"] == ["reward_len"]
    assert len(run["tokenizer"]["tokenizer_sha256"]) == 64 and run["trainer"]["per_device_train_batch_size"] == 4
    assert dumped.rollout_records.rows_written == 8 and dumped.rollout_records.seconds > 0
    # logs.jsonl holds every numeric value the step logged, TRL's own (reward, step_time, ...) included
    lines = [json.loads(line) for line in (tmp_path / "b" / "dump" / "logs.jsonl").read_text().splitlines()]
    logged = [h for h in dumped.state.log_history if "loss" in h]
    assert [line["logged_step"] for line in lines] == [h["step"] for h in logged] == [1, 2]
    for line, h in zip(lines, logged):
        assert {"reward", "step_time", "completions/mean_length", "rollout_corr/kl"} <= set(line["metrics"])
        assert all(line["metrics"][k] == v for k, v in h.items() if isinstance(v, (int, float)))


@pytest.mark.slow
def test_two_rank_dump_is_reproduced(llama_dir, tmp_path):
    """2 ranks (torchrun + gloo, real DDP): each rank writes its own step files; the recomputation merges both ranks'
    rows of each generation batch (global batch-normalisation mean) and matches the logged values."""
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump = tmp_path / "dump"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(Path(__file__).resolve().parents[1] / "helpers" / "dist_records_worker.py"), str(dump), str(llama_dir)]
    proc = run_torchrun(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"dump.rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["rows"] for r in ranks] == [8, 8]
    d = open_dump(dump)
    assert [len(w.files) for w in d.windows] == [2, 2] and d.metadata["world_size"] == 2
    unnormalised = NamedConfig("no batch norm", RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05))
    check, analyses, recomputer = analyse_dump(d, [unnormalised])
    assert check.ok and check.compared > 100 and check.max_abs_diff <= 1e-5, check.failures[:5]
    assert set(recomputer.rows.scalar["rank"].tolist()) == {0, 1}
    assert all(len(index) == 8 for index in recomputer.generations.values())  # 4 rows x 2 ranks per batch
    # without batch normalisation the weights differ by the global mean factor only: the same kept tokens and the
    # same (scale-free) Kish ESS
    trained, plain = (a.total.metrics() for a in analyses)
    for key in ("rollout_rs_masked_fraction", "rollout_is_eff_sample_size"):
        assert trained[f"rollout_corr/{key}"] == pytest.approx(plain[f"rollout_corr/{key}"], abs=1e-9)
    assert trained["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
    assert "rollout_corr/rollout_is_batch_norm_factor" not in plain
