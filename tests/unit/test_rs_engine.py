"""RS on the engine factor (``rollout_rs_on="engine"``, issue 23): every RS statistic and the RS mask come from
``pi_train@v / mu`` (the lag split's engine factor: numerics only), while IS weights the whole ratio ``pi_old / mu``.

On a constructed stale batch whole-ratio RS rejects the stale rows that engine-factor RS keeps (hand-computed masks);
at lag 0 both give the same weights, masks and metrics (the RS metrics renamed ``rollout_rs_engine_*``); the trainer
passes the lag split's log-probs (stale engine, float32 on both sides); bad configs are refused naming the fix;
``analyze`` reproduces an engine-RS run from its records (``version_log_probs``) and applies engine RS as a what-if
on a whole-ratio RS run (masks computed independently here), and refuses dumps without the column naming the fix."""

from __future__ import annotations

import math

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.correction import compute_rollout_correction, make_correction_fn

# mu = -1 everywhere; the engine factor e = log pi_train@v - log mu is small numerics noise, plus one engine outlier
# (row 2, token 1: 0.3 nats); row 0 is fresh (pi_old = pi_train@v), rows 1 and 2 are stale by 0.5 nats per token
MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
ENGINE = [[0.01, -0.02, 0.0], [0.01, 0.0, -0.01], [0.01, 0.3, 0.0]]
LAG = [[0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, 0.5, 0.0]]


def _batch():
    mu = torch.full((3, 3), -1.0, dtype=torch.float64)
    at_version = mu + torch.tensor(ENGINE, dtype=torch.float64)
    old = at_version + torch.tensor(LAG, dtype=torch.float64)
    return old, mu, torch.tensor(MASK), at_version


def _config(rs_on, rs="token_k1", threshold="0.8_1.25"):
    return RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=rs,
                                   rollout_rs_threshold=threshold, rollout_rs_on=rs_on)


def _rename(metrics):
    return {k.replace("rollout_rs_engine_", "rollout_rs_").replace("rs_engine_masked", "rs_masked"): v
            for k, v in metrics.items()}


def _short(metrics):
    return {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}



def test_whole_ratio_rs_rejects_stale_tokens_that_engine_factor_rs_keeps():
    old, mu, mask, at_version = _batch()
    direct = compute_rollout_correction(old, mu, mask, _config("direct"))
    engine = compute_rollout_correction(old, mu, mask, _config("engine"), rs_log_probs=at_version)
    # token_k1 band [0.8, 1.25] keeps |x| <= log 1.25 = 0.2231. Whole ratio x = engine + lag: row 0 within, rows 1
    # and 2 at 0.49..0.8: every stale token rejected. Engine factor: only the 0.3-nat engine outlier is rejected.
    assert direct.response_mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert engine.response_mask.tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]
    # IS weights the whole ratio in both: min(exp(x), 2), 0 at padding
    x = old - mu
    expected = torch.where(torch.tensor(MASK) > 0, torch.exp(x).clamp(max=2.0), 0.0).float()
    assert torch.equal(engine.weights, direct.weights)
    assert torch.allclose(engine.weights, expected, rtol=1e-6)
    assert engine.weights[2, 1].item() == 2.0  # exp(0.8) = 2.2255, truncated: IS still sees the stale ratio
    d, e = _short(direct.metrics), _short(engine.metrics)
    assert d["rollout_rs_token_k1_masked_fraction"] == pytest.approx(5 / 8)  # 3 + 2 stale tokens
    assert e["rollout_rs_engine_token_k1_masked_fraction"] == pytest.approx(1 / 8)
    assert e["rollout_rs_engine_masked_fraction"] == pytest.approx(1 / 8)
    assert e["rollout_rs_engine_seq_masked_fraction"] == pytest.approx(1 / 3)
    # the logged names say which ratio RS judged; nothing else changes (IS, kl, ... are of the whole ratio)
    assert not any(k.startswith("rollout_rs_token") or k == "rollout_rs_masked_fraction" for k in e)
    assert "len_0_64/rs_engine_masked_fraction" in e and "len_0_64/rs_masked_fraction" not in e
    others = [k for k in d if "rs_" not in k]
    assert len(others) > 20 and {k: e[k] for k in others} == {k: d[k] for k in others}
    assert e["rollout_rs_engine_token_k1_max"] == pytest.approx(0.02)  # k1 = -x of the engine factor


def test_sequence_option_on_the_engine_factor():
    old, mu, mask, at_version = _batch()
    cfg = ("seq_mean_k3", 0.01)
    direct = compute_rollout_correction(old, mu, mask, _config("direct", *cfg))
    engine = compute_rollout_correction(old, mu, mask, _config("engine", *cfg), rs_log_probs=at_version)
    # k3(x) = exp(x) - 1 - x; whole ratio: row 1 mean k3 ~ 0.1487 > 0.01 and row 2 ~ 0.28: rejected
    assert direct.response_mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    # engine factor: row 1 mean (k3(0.01) + 0 + k3(-0.01)) / 3 = 3.3e-5 kept; row 2 (k3(0.01) + k3(0.3)) / 2 = 0.02496
    k3 = lambda v: math.exp(v) - 1 - v  # noqa: E731
    assert (k3(0.01) + k3(0.3)) / 2 == pytest.approx(0.024954, rel=1e-4)
    assert engine.response_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
    row2 = (k3(0.01) + k3(0.3)) / 2
    assert engine.metrics["rollout_corr/rollout_rs_engine_seq_mean_k3_seq_max"] == pytest.approx(row2)


def test_lag_zero_gives_identical_results_for_direct_and_engine():
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(6, 7, generator=g) * 3  # float32 both sides
    old = mu + 0.05 * torch.randn(6, 7, generator=g)
    mask = (torch.arange(7) < torch.tensor([7, 5, 1, 7, 3, 6]).unsqueeze(1)).long()
    for rs, threshold in (("token_k1,seq_mean_k3", "0.9_1.1,0.001"), ("token_binary_kl,seq_max_k2", "0.1,0.002")):
        direct = compute_rollout_correction(old, mu, mask, _config("direct", rs, threshold))
        fn = make_correction_fn(_config("engine", rs, threshold))
        engine = fn(old, mu, mask, rs_log_probs=old.clone())  # lag 0: pi_train@v is pi_old exactly
        assert torch.equal(engine.response_mask, direct.response_mask)
        assert torch.equal(engine.weights, direct.weights)
        assert 0 < int(direct.response_mask.sum()) < int(mask.sum())  # RS acts
        assert _rename(engine.metrics) == direct.metrics


def test_rows_losing_tokens_to_a_non_finite_engine_factor_count_as_rs_masked_rows():
    """A valid token whose pi_train@v is NaN (e.g. outside the version's recomputed support) is rejected by RS; its row
    lost tokens to RS, so the combined seq_masked_fraction counts it as the mask does (it read 0 of 3 here)."""
    mu = torch.full((3, 3), -1.0)
    at_version = mu.clone()
    at_version[1, 0] = float("nan")  # row 1 loses one token, row 2 every token, row 0 none
    at_version[2, :] = float("nan")
    cfg = RolloutCorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=0.5, rollout_rs_on="engine")
    out = compute_rollout_correction(mu.clone(), mu, torch.ones(3, 3), cfg, rs_log_probs=at_version)
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 0]]
    m = _short(out.metrics)
    assert m["rollout_rs_engine_masked_fraction"] == pytest.approx(4 / 9)
    assert m["rollout_rs_engine_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_rs_engine_token_k3_masked_fraction"] == 0.0  # the option itself rejected nothing


def test_option_statistics_are_over_the_rows_with_a_finite_engine_factor():
    """Each option's own metrics (mean, row mean/min/max, ...; k3 in float32, hence rel 1e-6) are over the tokens
    and rows with a finite engine factor: a row with none is no row of them (it read as a 0: seq_min 0, seq_mean over
    3 rows), while the combined fractions stay over the correction's tokens and rows. With no finite engine factor
    at all they are absent."""
    mu = torch.full((3, 3), -1.0, dtype=torch.float64)
    nan = float("nan")
    e = [[0.1, 0.2, 0.3], [nan, 0.2, -0.2], [nan, nan, nan]]
    k3 = lambda v: math.exp(v) - 1 - v  # noqa: E731
    row0, row1 = (k3(0.1) + k3(0.2) + k3(0.3)) / 3, (k3(0.2) + k3(-0.2)) / 2
    cfg = RolloutCorrectionConfig(rollout_rs="token_k3,seq_mean_k3", rollout_rs_threshold="0.5,0.5",
                                  rollout_rs_on="engine")
    out = compute_rollout_correction(mu.clone(), mu, torch.ones(3, 3), cfg,
                                     rs_log_probs=mu + torch.tensor(e, dtype=torch.float64))
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 0]]
    m = _short(out.metrics)
    tokens = 3 * row0 + 2 * row1  # the five finite tokens' k3
    for option in ("token_k3", "seq_mean_k3"):
        p = f"rollout_rs_engine_{option}_"
        assert m[p + "seq_mean"] == pytest.approx((row0 + row1) / 2, rel=1e-6)  # was (row0 + row1) / 3
        assert m[p + "seq_min"] == pytest.approx(row1, rel=1e-6)  # was 0 (row 2)
        assert m[p + "seq_max"] == pytest.approx(row0, rel=1e-6)
        assert m[p + "seq_std"] == pytest.approx(abs(row0 - row1) / math.sqrt(2), rel=1e-5)
        assert m[p + "masked_fraction"] == 0.0 and m[p + "seq_masked_fraction"] == 0.0
    assert m["rollout_rs_engine_token_k3_mean"] == pytest.approx(tokens / 5, rel=1e-6)  # was / 9
    assert m["rollout_rs_engine_token_k3_max"] == pytest.approx(k3(0.3), rel=1e-6)
    assert m["rollout_rs_engine_token_k3_min"] == pytest.approx(k3(0.1), rel=1e-6)
    assert m["rollout_rs_engine_seq_mean_k3_mean"] == pytest.approx(tokens / 5, rel=1e-6)
    assert m["rollout_rs_engine_masked_fraction"] == pytest.approx(4 / 9)  # the combined: the correction's tokens
    assert m["rollout_rs_engine_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["num_valid_tokens"] == 9 and m["num_valid_seqs"] == 3
    none = compute_rollout_correction(mu.clone(), mu, torch.ones(3, 3), cfg, rs_log_probs=torch.full((3, 3), nan))
    assert none.response_mask.sum() == 0
    m = _short(none.metrics)
    assert not any(k.startswith(("rollout_rs_engine_token", "rollout_rs_engine_seq_mean_k3")) for k in m)
    assert m["rollout_rs_engine_masked_fraction"] == 1.0 and m["rollout_rs_engine_seq_masked_fraction"] == 1.0


def test_bad_inputs_to_the_correction():
    old, mu, mask, at_version = _batch()
    with pytest.raises(ValueError, match=r"rollout_rs_on='engine' .*no rs_log_probs.*set policy_lag_split=True"):
        compute_rollout_correction(old, mu, mask, _config("engine"))
    with pytest.raises(ValueError, match="rs_log_probs is read only with rollout_rs_on='engine'"):
        compute_rollout_correction(old, mu, mask, _config("direct"), rs_log_probs=at_version)
    with pytest.raises(ValueError, match=r"rs_log_probs must be \(B, T\) like log_probs"):
        compute_rollout_correction(old, mu, mask, _config("engine"), rs_log_probs=at_version[:, :2])


def test_config_values_and_refusals():
    assert RolloutCorrectionConfig().rollout_rs_on == "direct"
    assert _config("engine").to_dict()["rollout_rs_on"] == "engine"
    with pytest.raises(ValueError, match=r"rollout_rs_on must be 'direct' or 'engine', got 'proximal'"):
        _config("proximal")
    with pytest.raises(ValueError, match=r"rollout_rs_on='engine' is set but rollout_rs is off"):
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs_on="engine")
    with pytest.raises(ValueError, match=r"rollout_rs_on='engine' needs decoupled mode"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, rollout_rs_on="engine",
                                bypass_mode=True)


def test_trainer_config_needs_the_lag_split(make_args, tmp_path):
    with pytest.raises(ValueError, match=r"rollout_rs_on='engine' .*set policy_lag_split=True"):
        make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs", rollout_rs_on="engine")
    args = make_args(tmp_path, rollout_corr_preset="decoupled_k3_rs", rollout_rs_on="engine", policy_lag_split=True)
    assert args.rollout_correction().rollout_rs_on == "engine" and args.rollout_rs_on == "engine"
    with pytest.raises(ValueError, match=r"rollout_rs_on='engine' is set but rollout_rs is off"):
        make_args(tmp_path, rollout_corr_preset="decoupled_token_is", rollout_rs_on="engine", policy_lag_split=True)


# ---------------------------------------------------------------------------------------------- the trainer
def _train(model_dir, tmp_path, sync_interval, rs_on, max_steps=4):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / f"{rs_on}_{sync_interval}"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=max_steps, logging_steps=1, report_to=[], use_cpu=True,
        learning_rate=1e-3, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, bf16=False,
        rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold=1e-4, policy_lag_split=True,
        rollout_rs_on=rs_on)
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=StaleRollout(sync_interval))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.usefixtures("_silence_trl_experimental")
def test_trainer_engine_rs_keeps_the_stale_rows_whole_ratio_rs_rejects(llama_dir, tmp_path):
    """A stale engine in float32 (sync every 3 steps): the engine factor is 1 to float rounding, so engine-factor RS
    keeps every token, while whole-ratio RS (seq_mean_k3 1e-4) rejects the stale rows; IS still sees the lag."""
    direct = _train(llama_dir, tmp_path, 3, "direct")
    engine = _train(llama_dir, tmp_path, 3, "engine")
    stale = [i for i, log in enumerate(direct) if log["rollout_corr/policy_lag_mean"] > 0]
    assert stale and stale == [i for i, log in enumerate(engine) if log["rollout_corr/policy_lag_mean"] > 0]
    assert max(direct[i]["rollout_corr/rollout_rs_masked_fraction"] for i in stale) > 0.5
    for log in engine:
        assert log["rollout_corr/rollout_rs_engine_masked_fraction"] == 0.0, log["step"]
        assert "rollout_corr/rollout_rs_masked_fraction" not in log
        assert abs(log["rollout_corr/engine_ratio_max"] - 1.0) < 1e-5
    assert max(abs(engine[i]["rollout_corr/rollout_is_mean"] - 1.0) for i in stale) > 1e-3  # IS weights the lag
    # step 1 is at lag 0: both runs are the same step
    assert engine[0]["loss"] == direct[0]["loss"] and engine[0]["grad_norm"] == direct[0]["grad_norm"]


@pytest.mark.slow
@pytest.mark.usefixtures("_silence_trl_experimental")
def test_trainer_lag_zero_direct_and_engine_are_identical(llama_dir, tmp_path):
    """Sync every step (lag 0), float32 on both sides: the same training, the same values under the RS names."""
    direct = _train(llama_dir, tmp_path, 1, "direct", max_steps=2)
    engine = _train(llama_dir, tmp_path, 1, "engine", max_steps=2)
    for d, e in zip(direct, engine):
        e = _rename(e)
        assert set(e) == set(d)
        for key, value in d.items():
            if key not in ("train_runtime", "step_time") and "per_second" not in key:
                assert e[key] == value, key


# ---------------------------------------------------------------------------------------------- analyze
OUTLIER = 0.3  # nats: the noisy engine's mu is this much too low on every third token (ratio e^0.3 = 1.35)
BAND = (0.8, 1.25)  # the token_k1 band of the tests below: the outliers leave it, the rest of the engine factor not


class _NoisyEngine(StaleRollout):
    """``StaleRollout`` (float32, stale on its schedule) whose mu is ``OUTLIER`` nats low at completion positions
    1, 4, 7, ...: engine outliers that the engine factor pi_train@v / mu sees, next to the staleness it does not."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        out["logprobs"] = [[lp - OUTLIER if j % 3 == 1 else lp for j, lp in enumerate(row)] for row in out["logprobs"]]
        return out


def _train_dump(model_dir, tmp_path, rs_on):
    """4 steps with the noisy engine synced every 3 steps (lags 0, 1, 2, 0), token TIS 2.0 + token_k1 RS ``BAND``,
    ``policy_lag_split``, every step recorded; returns (the step logs, the dump path)."""
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    dump = tmp_path / f"dump_{rs_on}"
    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / f"out_{rs_on}"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=4, logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3,
        save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, bf16=False, rollout_is="token",
        rollout_is_threshold="2.0", rollout_rs="token_k1", rollout_rs_threshold=f"{BAND[0]}_{BAND[1]}",
        policy_lag_split=True, rollout_rs_on=rs_on, rollout_dump_dir=str(dump))
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=_NoisyEngine(3))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], dump


def _engine_band_keep(rows):
    """(N, T) bool: the token_k1 band on the engine factor, computed here in float64 from the dump's columns:
    valid completion tokens with BAND[0] <= exp(version_log_probs - rollout_log_probs) <= BAND[1]."""
    from trl_rollout_corr.records import padded

    mask = padded(rows.table, "completion_mask", fill=0, dtype=torch.int64) != 0
    nan = float("nan")
    version = padded(rows.table, "version_log_probs", fill=nan, dtype=torch.float64)
    mu = padded(rows.table, "rollout_log_probs", fill=nan, dtype=torch.float64)
    old = padded(rows.table, "old_log_probs", fill=nan, dtype=torch.float64)
    valid = mask & torch.isfinite(mu) & torch.isfinite(old)
    ratio = torch.exp(version - mu)
    return valid, valid & (ratio >= BAND[0]) & (ratio <= BAND[1])


def _strip_column(dump, name):
    import pyarrow.parquet as pq

    for step_file in dump.glob("**/*.parquet"):
        table = pq.read_table(step_file)
        pq.write_table(table.drop_columns([name]).replace_schema_metadata(table.schema.metadata), step_file)


@pytest.mark.usefixtures("_silence_trl_experimental")
def test_analyze_reproduces_an_engine_rs_run(llama_dir, tmp_path):
    """A run with RS on the engine factor and stale rollouts: analyze recomputes every logged rollout_corr/* value
    (the rollout_rs_engine_* ones included) from the records' version_log_probs, the recorded RS mask is the band on
    the engine factor computed here, and the dump without version_log_probs is refused naming the fix."""
    from trl_rollout_corr.analyze import ConfigError, analyse_dump
    from trl_rollout_corr.records import open_dump

    logs, dump_dir = _train_dump(llama_dir, tmp_path, "engine")
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0, 0.0]
    for log in logs[:3]:  # the outliers (about 3 of 8 tokens) are rejected, the stale rest kept (step 4: 1 token)
        assert 0.2 < log["rollout_corr/rollout_rs_engine_masked_fraction"] < 0.5, log["step"]
    assert not any("rollout_corr/rollout_rs_masked_fraction" in log for log in logs)
    check, _, recomputer = analyse_dump(open_dump(dump_dir), [])
    assert check.ok and not check.not_recomputed and not check.skipped, check.failures[:5]
    assert check.max_abs_diff <= 1e-5
    engine_keys = {k for log in logs for k in log if "rs_engine_" in k}  # all compared: none is not recomputed
    assert {"rollout_corr/rollout_rs_engine_token_k1_masked_fraction", "rollout_corr/rollout_rs_engine_token_k1_min",
            "rollout_corr/rollout_rs_engine_seq_masked_fraction",
            "rollout_corr/len_0_64/rs_engine_masked_fraction"} <= engine_keys
    assert check.compared >= 4 * 80  # 340: the three length slices without a row log only their num_seqs
    # the trainer's recorded RS mask is the band on the engine factor (not on pi_old / mu)
    valid, keep = _engine_band_keep(recomputer.rows)
    recorded = recomputer.rows.full("rollout_rs_mask", dtype=torch.int64)
    width = min(recorded.shape[1], keep.shape[1])
    assert torch.equal(recorded[:, :width] != 0, keep[:, :width])
    assert int((valid & ~keep).sum()) > 0
    _strip_column(dump_dir, "version_log_probs")
    with pytest.raises(ConfigError, match=r"rollout_rs_on='engine'.*'version_log_probs'.*this dump has none: "
                                          r"re-run the training with policy_lag_split: true"):
        analyse_dump(open_dump(dump_dir), [])


@pytest.mark.usefixtures("_silence_trl_experimental")
def test_what_if_engine_rs_on_a_direct_rs_dump(llama_dir, tmp_path):
    """``analyze --config`` with rollout_rs_on: engine on a run trained with RS on the whole ratio (policy_lag_split
    on): the what-if's kept tokens and per-step rollout_rs_engine_masked_fraction are those of the band on the
    engine factor computed here; IS is the same as the trained run's (it weights the whole ratio either way)."""
    from trl_rollout_corr.analyze import analyse_dump, yaml_config
    from trl_rollout_corr.records import open_dump

    logs, dump_dir = _train_dump(llama_dir, tmp_path, "direct")
    f = tmp_path / "engine.yaml"
    f.write_text(f"rollout_is: token\nrollout_is_threshold: 2.0\nrollout_rs: token_k1\n"
                 f"rollout_rs_threshold: {BAND[0]}_{BAND[1]}\nrollout_rs_on: engine\n")
    check, (trained, what_if), recomputer = analyse_dump(open_dump(dump_dir), [yaml_config(f)])
    assert check.ok and not check.not_recomputed, check.failures[:5]
    valid, keep = _engine_band_keep(recomputer.rows)
    assert what_if.total.counts.valid_tokens == int(valid.sum())
    assert what_if.total.counts.kept_tokens == int(keep.sum())
    steps = recomputer.rows.scalar["logged_step"]
    for w in what_if.windows:  # one use per row (steps_per_generation 1): a step's rows are its generation batch
        sel = steps == w.logged_step
        expected = 1.0 - int(keep[sel].sum()) / int(valid[sel].sum())
        m = what_if.per_window[w.logged_step].metrics()
        assert m["rollout_corr/rollout_rs_engine_masked_fraction"] == pytest.approx(expected, abs=1e-12)
        t = trained.per_window[w.logged_step].metrics()
        assert m["rollout_corr/rollout_is_mean"] == t["rollout_corr/rollout_is_mean"]
    # whole-ratio RS rejected the stale tokens' lag too: at least as much as the engine factor's band
    assert trained.total.counts.kept_tokens <= what_if.total.counts.kept_tokens


def test_analyze_refuses_engine_rs_without_version_log_probs(tmp_path, capsys):
    """A what-if with rollout_rs_on: engine on a dump without version_log_probs (the hand dump: records 1.0, no
    policy_lag_split): a clear error naming the fix, from the library and from the CLI."""
    from hand_dump import hand_dump
    from trl_rollout_corr.analyze import ConfigError, analyse_dump, yaml_config
    from trl_rollout_corr.cli import EXIT_BAD_INPUT, main
    from trl_rollout_corr.records import open_dump

    dump = hand_dump(tmp_path / "d")
    f = tmp_path / "engine.yaml"
    f.write_text("rollout_rs: seq_mean_k3\nrollout_rs_threshold: 0.01\nrollout_rs_on: engine\n")
    named = yaml_config(f)  # a valid config: the dump decides
    assert named.config.rollout_rs_on == "engine"
    with pytest.raises(ConfigError, match=r"config 'engine' has rollout_rs_on='engine'.*needs column "
                                          r"'version_log_probs'.*re-run the training with policy_lag_split: true "
                                          r"\(rollout records schema >= 1.1"):
        analyse_dump(open_dump(dump), [named])
    assert main(["analyze", str(dump), "--config", str(f), "--no-plots"]) == EXIT_BAD_INPUT
    assert "policy_lag_split: true" in capsys.readouterr().err
