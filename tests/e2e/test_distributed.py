"""Multi-rank runs on CPU (torchrun + gloo, and DeepSpeed ZeRO-2): the rollout_corr/* values of 2 ranks equal those
of 1 rank on the same global batch, RS-rejected rows leave their group baselines across ranks, and the logged
token counts are global. The worker is ``tests/helpers/dist_worker.py`` (minutes: each test spawns torchrun twice)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from torchrun import run_torchrun


# ---------------------------------------------------------------------------------------------- two ranks on CPU
def _launch(nproc: int, out_json, model_dir, port: int, *extra: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           os.path.join(os.path.dirname(__file__), "../helpers/dist_worker.py"), str(out_json), str(model_dir), *extra]
    proc = run_torchrun(cmd, env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
    assert proc.returncode == 0, "\n".join(errors[-20:]) + proc.stderr[-3000:]
    return [json.load(open(f"{out_json}.rank{r}")) for r in range(nproc)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank(llama_dir, tmp_path):
    """torchrun --nproc_per_node 2 with use_cpu=True (real DDP over gloo) vs 1 rank, same global batch."""
    two = _launch(2, tmp_path / "two.json", llama_dir, _free_port())
    one = _launch(1, tmp_path / "one.json", llama_dir, _free_port())
    assert [r["world"] for r in two] == [2, 2] and one[0]["world"] == 1
    assert two[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    for case, ref in one[0]["exact"].items():
        got = two[0]["exact"][case]
        assert got == two[1]["exact"][case]  # every rank logs the same values
        assert set(got) == set(ref) and len(ref) > 20
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (case, key)
        # uneven shards: 10 + 1000 valid tokens, one of them NaN -> invalid
        assert ref["rollout_corr/num_valid_tokens"] == 1009
        assert ref["rollout_corr/invalid_token_fraction"] == pytest.approx(1 / 1010)
        assert got["rollout_corr/engine_ratio_p50"] == ref["rollout_corr/engine_ratio_p50"]  # exact order statistics
    # fully rejected rows across ranks: advantage 0, and the group baselines use only the kept rows of all ranks
    n_rejected = 0
    for gen0, gen1 in zip(two[0]["rs_rows"], two[1]["rs_rows"]):
        assert gen0["rewards"] == gen1["rewards"]
        rewards = gen0["rewards"]
        rejected = gen0["rejected"] + gen1["rejected"]
        advantages = gen0["advantages"] + gen1["advantages"]
        n_rejected += sum(rejected)
        for g in range(0, len(rewards), 4):
            kept = [rewards[i] for i in range(g, g + 4) if not rejected[i]]
            for i in range(g, g + 4):
                if rejected[i] or len(kept) < 2:
                    expected = 0.0
                else:
                    mean = sum(kept) / len(kept)
                    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / (len(kept) - 1))
                    expected = (rewards[i] - mean) / (std + 1e-4)
                assert advantages[i] == pytest.approx(expected, abs=1e-4), (g, i)
    assert n_rejected > 0
    # real 2-rank training: the logged token count is the global one (sum over ranks, not a mean of ranks)
    for preset, logs in two[0]["train"].items():
        assert len(logs) == 2
        for log in logs:
            assert math.isfinite(log["loss"])
            assert log["num_valid_tokens"] == pytest.approx(log["mean_length"] * log["global_rows"])
            assert log["global_rows"] == 8


def test_two_ranks_policy_lag_match_one_rank(llama_dir, tmp_path):
    """Sync interval 3 + num_iterations 2 + max_policy_lag 2 on 2 ranks (4 rows each) and on 1 rank (8 rows): every
    row's version at the loss and the logged rollout_corr/policy_lag_* are the same, and equal the hand count."""
    two = _launch(2, tmp_path / "two.json", llama_dir, _free_port(), "lag")
    one = _launch(1, tmp_path / "one.json", llama_dir, _free_port(), "lag")
    assert [r["world"] for r in two] == [2, 2] and one[0]["world"] == 1
    assert two[0]["logs"] == two[1]["logs"] == one[0]["logs"]
    # generations at steps 0 and 2, both with the weights of step 0 (the next sync is due at step 3): lags 0..3
    expected_versions = [[step, [0] * 4] for step in range(4)]
    assert two[0]["seen"] == two[1]["seen"] == expected_versions
    assert one[0]["seen"] == [[step, [0] * 8] for step in range(4)]
    logs = one[0]["logs"]
    assert [log["rollout_corr/policy_lag_mean"] for log in logs] == [0.0, 1.0, 2.0, 3.0]
    assert [log["rollout_corr/policy_lag_max"] for log in logs] == [0.0, 1.0, 2.0, 3.0]
    assert [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs] == [0.0, 0.0, 0.0, 1.0]
    assert [log["rollout_corr/policy_lag_fraction_2_3"] for log in logs] == [0.0, 0.0, 1.0, 1.0]


def test_two_ranks_skip_empty_steps_is_one_global_decision(llama_dir, tmp_path):
    """skip_empty_steps on 2 ranks: at step 1 only rank 1 trains tokens (rank 0's rows are all dropped), so both
    ranks step (the weights move); at step 2 no rank trains a token, so both skip (the weights stay bit-identical)."""
    two = _launch(2, tmp_path / "skip.json", llama_dir, _free_port(), "skip")
    assert [r["world"] for r in two] == [2, 2]
    assert two[0]["skipped"] == two[1]["skipped"] == [2]
    assert two[0]["sums"] == two[1]["sums"]  # DDP: one model
    sums = two[0]["sums"]
    assert sums[1] != sums[0] and sums[2] == sums[1] and sums[3] != sums[2]
    logs = two[0]["logs"]
    assert [log["rollout_corr/skipped_step_fraction"] for log in logs] == [0.0, 0.0, 1.0, 0.0]
    assert [log["rollout_corr/policy_lag_dropped_fraction"] for log in logs] == [0.0, 0.5, 1.0, 0.0]


def test_deepspeed_zero2_two_ranks_trains_logs_exactly_and_exits_cleanly(llama_dir, tmp_path):
    """ZeRO-2 DeepSpeedEngine on 2 CPU ranks (torchrun + deepspeed= config): exit code 0 on every rank, and the
    rollout_corr/* values equal the 1-rank values on the same global batch."""
    pytest.importorskip("deepspeed")
    two = _launch(2, tmp_path / "ds.json", llama_dir, _free_port(), "deepspeed")  # asserts returncode == 0
    one = _launch(1, tmp_path / "one.json", llama_dir, _free_port())
    assert two[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert set(two[0]["engine"].values()) == {"DeepSpeedEngine"}
    for case, ref in one[0]["exact"].items():
        got = two[0]["exact"][case]
        assert got == two[1]["exact"][case] and set(got) == set(ref)
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (case, key)
    for preset, logs in two[0]["train"].items():
        for log in logs:
            assert math.isfinite(log["loss"])
            assert log["num_valid_tokens"] == pytest.approx(log["mean_length"] * 8)

