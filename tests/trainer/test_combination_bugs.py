"""Issue 22's feature-combination bugs, one test each, through the public trainer API on tiny float32 models with a
stale rollout engine (``stale_rollout.StaleRollout``): bypass batch normalisation with ``max_policy_lag`` drops and
gradient accumulation; ``policy_lag_split`` with support matching and with routing replay; ``analyze`` on a
``policy_lag_split`` run with stale rollouts."""

from __future__ import annotations

import math

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

ENGINE_KEYS = [f"rollout_corr/engine_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]


pytestmark = pytest.mark.usefixtures("_silence_trl_experimental")  # rollout_func is experimental in TRL


def _train(model_dir, tmp_path, rollout, **overrides):
    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "learning_rate": 1e-3, "save_strategy": "no", "beta": 0.0, "seed": 0, "disable_tqdm": True, "bf16": False,
        "rollout_corr_preset": "decoupled_token_is", **overrides})
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=rollout)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


class _HalfFresher(StaleRollout):
    """Sync interval 3, but every even row reports one version newer than it is (never ahead of the trainer): on the
    step where the engine is 2 steps stale, half the rows are lag 1 (kept by max_policy_lag=1) and half lag 2
    (dropped), and the kept rows' IS weights are not 1 (their mu is 2 steps stale)."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        step = int(trainer.state.global_step)
        out["policy_version"] = [v + 1 if i % 2 == 0 and v + 1 <= step else v
                                 for i, v in enumerate(out["policy_version"])]
        return out


def test_bypass_batch_norm_excludes_the_rows_max_policy_lag_drops(llama_dir, tmp_path):
    """Micro-batch 8 x accumulation 1 and micro-batch 4 x accumulation 2 are the same optimizer step (8 rows, one
    generation): with max_policy_lag drops the batch-norm mean must be over the kept rows in both, so the grad norms
    and the logged (applied) factor agree. Measured on main before the fix: step 3 grad norm 12.03 (8 x 1) vs 19.91
    (4 x 2) while both logged the same factor 0.0392 (not the one 4 x 2 applied)."""
    runs = {}
    for mb, ga in ((8, 1), (4, 2)):
        _, logs = _train(llama_dir, tmp_path / f"{mb}x{ga}", _HalfFresher(sync_interval=3), max_steps=3,
                         rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True, max_policy_lag=1,
                         per_device_train_batch_size=mb, gradient_accumulation_steps=ga, loss_type="grpo")
        runs[(mb, ga)] = logs
    whole, split = runs[(8, 1)], runs[(4, 2)]
    dropped = [log["rollout_corr/policy_lag_dropped_fraction"] for log in whole]
    assert dropped[0] == 0.0 and 0.0 < dropped[2] < 1.0, dropped  # a step with some rows dropped, some kept
    factor = "rollout_corr/rollout_is_batch_norm_factor"
    assert abs(whole[2][factor] - 1.0) > 1e-3  # the normalisation acts on the step with drops
    for a, b in zip(whole, split):
        assert b["rollout_corr/policy_lag_dropped_fraction"] == a["rollout_corr/policy_lag_dropped_fraction"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
        assert b[factor] == pytest.approx(a[factor], rel=1e-5), a["step"]


def _assert_engine_ratio_is_one_on_stale_steps(logs):
    stale = [log for log in logs if log["rollout_corr/policy_lag_mean"] > 0]
    assert stale, "no stale step"
    for log in logs:
        for key in ENGINE_KEYS:
            assert abs(log[key] - 1.0) < 1e-5, (log["step"], key, log[key])
    # the staleness is in the lag ratio
    assert max(abs(log["rollout_corr/lag_ratio_max"] - 1.0) for log in stale) > 1e-3


def test_lag_split_scores_the_version_forward_over_the_engines_support(llama_dir, tmp_path):
    """A float32 top-p 0.8 engine, sync interval 3, support matching "recompute": pi_train@v over the engine's
    support is mu exactly, so the stale steps' engine ratio is 1 to 1e-5 (before: median ~0.80, 1/S absorbed by the
    lag ratio)."""
    _, logs = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3, top_p=0.8), max_steps=4,
                     policy_lag_split=True, rollout_support_matching="recompute", top_p=0.8)
    _assert_engine_ratio_is_one_on_stale_steps(logs)


def test_lag_split_replays_each_rows_own_routes_in_the_version_forward(tmp_path):
    """A tiny Qwen3-MoE engine (float32, its routes returned), sync interval 3, routing_replay="r3", generation
    batches of two forward chunks: the version forward with each row's own routes is the engine's forward, so the
    stale steps' engine ratio is 1 to 1e-5 (issue 22 measured p01 0.83 / max 1.87; here the step-3 mean is 0.975)."""
    moe = make_tiny_model_dir(str(tmp_path / "moe"), "qwen3_moe", seed=0)
    _, logs = _train(moe, tmp_path, StaleRollout(sync_interval=3, routes=True), max_steps=4,
                     policy_lag_split=True, routing_replay="r3", router_aux_loss_coef=0.0,
                     gradient_accumulation_steps=2)  # 8 rows a generation, scored in two chunks of 4
    _assert_engine_ratio_is_one_on_stale_steps(logs)


def test_analyze_reproduces_the_lag_split_engine_ratio_of_stale_rollouts(llama_dir, tmp_path):
    """The records hold pi_train@v (``version_log_probs``): analyze recomputes the split's engine ratio as
    version - mu and its lag ratio as old - version, equal to the logged values at the default tolerance (1e-5); on
    main before the fix it recomputed engine_ratio_* as pi_old / mu and reported MISMATCH (exit 1)."""
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    _, logs = _train(llama_dir, tmp_path, StaleRollout(sync_interval=3), max_steps=4, policy_lag_split=True,
                     rollout_dump_dir=str(tmp_path / "dump"))
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0, 0.0]
    dump = open_dump(tmp_path / "dump")
    check, analyses, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped, check.failures[:3]
    lag_keys = [f"rollout_corr/lag_ratio_{q}" for q in ("mean", "p01", "p50", "p99", "max")]
    assert not set(ENGINE_KEYS + lag_keys) & check.not_recomputed  # both recomputed, and equal
    assert all(math.isfinite(log[k]) for log in logs for k in ENGINE_KEYS)
    for log in logs:  # the stale steps' engine ratio is 1 (float32 engine), the staleness is in the lag ratio
        ours = analyses[0].per_window[log["step"]].metrics()
        for key in ENGINE_KEYS + lag_keys:
            assert ours[key] == pytest.approx(log[key], abs=1e-5 * max(1.0, abs(log[key]))), (log["step"], key)
    assert abs(logs[2]["rollout_corr/lag_ratio_max"] - 1.0) > 1e-3
    rows = dump.read_table()
    stale = [r for r in rows.to_pylist() if r["policy_version"] != r["step"]]
    assert stale and all(r["version_log_probs"] != r["old_log_probs"] for r in stale)


@pytest.mark.parametrize("preset,extra", [("decoupled_token_is", {}), ("decoupled_token_is", {"num_iterations": 2}),
                                          ("bypass_pg_is", {})], ids=["decoupled", "decoupled-reuse", "bypass"])
def test_analyze_reproduces_the_max_policy_lag_drops(llama_dir, tmp_path, preset, extra):
    """Issue 22: analyze refused dumps trained with max_policy_lag. It now drops the rows the trainer dropped (lag
    over the bound at generation: out of the correction; at use: out of the loss and the ratios) and reproduces
    every logged rollout_corr/* value, policy_lag_dropped_* included, at its default tolerance (1e-5); with
    num_iterations 2 rows also cross the bound between their two uses."""
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    _, logs = _train(llama_dir, tmp_path, _HalfFresher(sync_interval=3), max_steps=4, max_policy_lag=1,
                     rollout_corr_preset=preset, rollout_dump_dir=str(tmp_path / "dump"), **extra)
    dropped = [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs]
    assert max(dropped) > 0 and min(dropped) == 0, dropped
    check, analyses, _ = analyse_dump(open_dump(tmp_path / "dump"), [])
    assert check.ok and not check.skipped, check.failures[:3]
    assert not check.not_recomputed, check.not_recomputed
    assert sum("rollout_corr/rollout_is_mean" in log for log in logs) >= 2
    for log in logs:
        ours = analyses[0].per_window[log["step"]].metrics()
        for key in ("rollout_corr/policy_lag_dropped_fraction", "rollout_corr/policy_lag_dropped_token_fraction",
                    "rollout_corr/rollout_is_mean", "rollout_corr/direct_ratio_max"):
            if key not in log:  # rollout_is_*: logged in the window of a generation (not on num_iterations' reuse)
                continue
            assert ours[key] == pytest.approx(log[key], abs=1e-5 * max(1.0, abs(log[key]))), (log["step"], key)
    assert check.compared >= 20 * len(logs)


class _RoutesTruth(StaleRollout):
    """Keeps the routes it returned for each row, keyed by (prompt ids, completion ids)."""

    def __init__(self, **kw):
        super().__init__(routes=True, **kw)
        self.returned = {}

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        for p, c, r in zip(out["prompt_ids"], out["completion_ids"], out["routed_experts"]):
            self.returned[(tuple(p), tuple(c))] = torch.as_tensor(r)
        return out


def test_records_hold_the_replayed_routes_and_analyze_names_routing_as_not_recomputed(tmp_path):
    """Issue 22: with routing_replay='r3' the records' routes were never filled. routes_packed holds, per row, the
    routes the engine returned (prompt then completion tokens x MoE layers x top-k, one byte per expert id: L*k bytes
    a token), exactly; analyze reproduces the other logged values and names the routing_* ones as not recomputed
    (they need the trainer's own top-k, a model forward)."""
    import pyarrow.compute as pc

    from trl_rollout_corr.analyze import CheckResult, analyse_dump
    from trl_rollout_corr.records import open_dump, read_step_file, unpack_routes

    moe = make_tiny_model_dir(str(tmp_path / "moe"), "qwen3_moe", seed=0)
    engine = _RoutesTruth(sync_interval=1)
    _, logs = _train(moe, tmp_path, engine, max_steps=2, routing_replay="r3", router_aux_loss_coef=0.0,
                     rollout_dump_dir=str(tmp_path / "dump"))
    dump = open_dump(tmp_path / "dump")
    files = [p for w in dump.windows for p in w.files]
    n_rows = 0
    for path in files:
        table = read_step_file(path)
        assert table.schema.field("routes_packed").type == pa_binary()
        sizes = pc.binary_length(table.column("routes_packed")).to_pylist()
        tokens = [len(p) + len(c) for p, c in zip(table.column("prompt_ids").to_pylist(),
                                                   table.column("completion_ids").to_pylist())]
        assert sizes == [t * 2 * 2 for t in tokens]  # 2 MoE layers x top-2, one byte per id
        for p, c, routes in zip(table.column("prompt_ids").to_pylist(), table.column("completion_ids").to_pylist(),
                                unpack_routes(table)):
            truth = engine.returned[(tuple(p), tuple(c))]
            expected = torch.full((len(p) + len(c), 2, 2), -1, dtype=torch.int16)
            expected[:truth.shape[0]] = truth.to(torch.int16)
            assert torch.equal(routes, expected)
            assert bool((routes[:len(p)] >= 0).all()) and int(routes.max()) < 8  # every prompt token routed
            n_rows += 1
    assert n_rows == 8
    check, _, _ = analyse_dump(dump, [])
    assert check.ok and not check.skipped, check.failures[:3]
    routing = {k for log in logs for k in log if k.startswith("rollout_corr/routing_")}
    assert routing and check.not_recomputed == routing
    assert all("router top-k" in CheckResult.why_not_recomputed(k) for k in routing)
    assert "unknown" in CheckResult.why_not_recomputed("rollout_corr/some_future_metric")


def pa_binary():
    import pyarrow as pa

    return pa.binary()
