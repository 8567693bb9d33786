"""The policy-lag experiment's comparisons (benchmarks/policy_lag_experiment.py): which cell a cell is compared
with, and the paired statistics, against hand-computed values."""

import math
from pathlib import Path

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def exp():
    return load_script("benchmarks/policy_lag_experiment.py")


def test_reference_cells(exp):
    assert exp.reference_cell("warmstart") is None
    assert exp.reference_cell("trl_k1_s3") is None
    assert exp.reference_cell("trl_k8_s2") == "trl_k1_s2"  # the lag effect itself
    assert exp.reference_cell("tis_k8_s2") == "trl_k8_s2"
    assert exp.reference_cell("topp_recompute_k1_s2") == "topp_trl_is_k1_s2"
    assert exp.reference_cell("topp_trl_is_k1_s1") is None
    assert exp.reference_cell("topp_trl_is_k8_s1") == "topp_trl_is_k1_s1"


def test_paired_difference_and_exact_mcnemar_by_hand(exp):
    a = [1, 1, 1, 0, 0, 1, 1, 0]  # a right / b wrong on items 0, 1, 5; b right / a wrong on item 3
    b = [0, 0, 1, 1, 0, 0, 1, 0]
    m, se = exp.paired(a, b)
    d = [1, 1, 0, -1, 0, 1, 0, 0]  # mean 2/8; sample sd of d / sqrt(8)
    mean = sum(d) / 8
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 7)
    assert m == pytest.approx(0.25, abs=1e-12)
    assert se == pytest.approx(sd / math.sqrt(8), rel=1e-12)
    n10, n01, p = exp.mcnemar(a, b)
    assert (n10, n01) == (3, 1)
    assert p == pytest.approx(2 * (1 + 4) / 16, abs=1e-12)  # two-sided binomial(4, 1/2): P(X<=1)+P(X>=3) = 10/16


def test_issue23_methods_parse_and_carry_their_recipe_flags(exp, tmp_path):
    import argparse

    args = argparse.Namespace(out=str(tmp_path), lr=3e-5, steps=32, prompts=8, warmstart_steps=16)

    def flags(cell):
        f = exp.cell_flags(cell, tmp_path / cell, args)
        return f, dict(zip(f[::2], f[1::2])) if len(f) % 2 == 0 else None

    assert exp.parse_cell("rs_engine_k8_s1") == ("rs_engine", 8, 1)
    assert exp.parse_cell("f32_rs_direct_k8_s3") == ("f32_rs_direct", 8, 3)
    expected = {  # cell -> (policy_lag_split, rollout_rs_on, rollout_dtype); None: the flag is absent
        "rs_engine_k8_s1": ("true", "engine", None),
        "rs_direct_k8_s1": ("true", None, None),
        "f32_rs_engine_k8_s1": ("true", "engine", "float32"),
        "f32_rs_direct_k8_s1": ("true", None, "float32"),
        "decoupled_k8_s1": (None, None, None),  # unchanged: the whole-ratio arm with the split is rs_direct
    }
    for cell, (split, rs_on, dtype) in expected.items():
        f, kv = flags(cell)
        assert kv is not None, f
        assert kv["--config"].endswith("cpu_smollm2_decoupled.yaml")
        assert (kv["--rollout_sync_interval"], kv["--seed"], kv["--learning_rate"]) == ("8", "42", "3e-05")
        assert (kv.get("--policy_lag_split"), kv.get("--rollout_rs_on"), kv.get("--rollout_dtype")) == \
            (split, rs_on, dtype), cell
    assert exp.reference_cell("rs_engine_k8_s1") == "trl_k8_s1"  # the main table's reference stays plain TRL


def test_order_runs_the_calibration_then_the_grid_at_the_calibrated_interval(exp):
    calibration = ["warmstart", *(f"trl_k{k}_s{s}" for s in (1, 2, 3, 4) for k in (1, 8)),
                   "trl_k32_s1", "trl_k32_s2", "trl_k32_s3"]  # the max-lag calibration's seeds 1-3 first
    assert exp.GRID_K == 32
    assert exp.ORDER[:len(calibration)] == calibration
    grid = exp.ORDER[len(calibration):]
    # the priority arms at the calibrated k with 3 seeds, before anything else
    assert grid[:6] == [f"{m}_k32_s{s}" for m in ("tis", "bypass") for s in (1, 2, 3)]
    assert grid[6:10] == ["trl_slow_k32_s1", "decoupled_k32_s1", "trl_is_k32_s1", "direct_gate_k32_s1"]
    assert grid[10:13] == ["trl_slow_k32_s2", "trl_slow_k32_s3", "tis_k1_s1"]  # the control's seeds 2-3
    # issue 23's cells stay at RS_ON_K = 8 with their no-RS reference tis_k8_s1, then top-p, then the intermediate k
    assert grid[13:18] == [f"{m}_k8_s1" for m in ("rs_engine", "rs_direct", "tis", "f32_rs_engine", "f32_rs_direct")]
    assert exp.RS_ON_K == 8
    assert grid[18:24] == [f"{m}_k1_s{s}" for s in (1, 2) for m in ("topp_trl_is", "topp_decoupled",
                                                                     "topp_recompute")]
    assert grid[24:29] == ["tis_k8_s2", "tis_k8_s3", "bypass_k8_s1", "bypass_k8_s2", "bypass_k8_s3"]
    assert grid[29:30] == ["trl_k32_s4"]
    assert grid[30:33] == ["bypass_k1_s1", "bypass_k1_s2", "bypass_k1_s3"]  # the objective's control, after the grid
    assert grid[33:35] == ["bypass_k32_s4", "bypass_k1_s4"]  # bypass paired with plain TRL's 4th seed
    # issue 47's anchor/step-size controls at k = 32: lr / 4 on every seed first after seed 1's KL penalty, then the
    # rest seed by seed; every arm on seeds 1-3
    assert grid[35:39] == ["trl_lr4_k32_s1", "trl_beta01_k32_s1", "trl_lr4_k32_s2", "trl_lr4_k32_s3"]
    assert sorted(grid[35:]) == sorted(f"{m}_k32_s{s}" for s in (1, 2, 3) for m in ("trl_lr4", "trl_beta01",
                                                                                    "trl_lr8", "trl_beta1"))
    assert len(set(exp.ORDER)) == len(exp.ORDER)
    # every grid cell at k > 1 has its paired plain-TRL reference in the order, at the same k and seed, before it
    for c in exp.ORDER[1:]:
        ref = exp.reference_cell(c)
        if ref is not None and not c.startswith("topp_"):
            assert exp.ORDER.index(ref) < exp.ORDER.index(c), c


def _cell(root, name, steps, scores):
    """A synthetic committed cell: ``steps`` = [(policy_lag_mean, num_valid_tokens, {rs metric: value})]."""
    import json

    d = root / name
    d.mkdir()
    lines = [{"run_config": {}}]
    for j, (lag, n_tok, rs) in enumerate(steps, 1):
        lines.append({"step": j, "loss": 0.1, "step_time": 1.0, "rollout_corr/policy_lag_mean": lag,
                      "rollout_corr/policy_lag_max": lag, "rollout_corr/k3_kl": 0.001,
                      "rollout_corr/num_valid_tokens": n_tok, **rs})
    (d / "log.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (d / "eval.json").write_text(json.dumps({"after": {"scores": scores, "correct": sum(scores),
                                                       "total": len(scores), "accuracy": sum(scores) / len(scores)}}))


def test_issue23_table_by_hand(exp, tmp_path):
    eng, dire = "rollout_corr/rollout_rs_engine_masked_fraction", "rollout_corr/rollout_rs_masked_fraction"
    a = [1, 1, 1, 0, 0, 1, 1, 0]
    b = [0, 0, 1, 1, 0, 0, 1, 0]  # a - b: +25 points, paired s.e. sqrt(0.5 / 8) = 25 points; 3 vs 1 discordant
    # rs_engine: kept (90 + 200 + 80) / 400 tokens; lag 0: 90/100; stale (200 + 80) / 300
    _cell(tmp_path, "rs_engine_k8_s1", [(0, 100, {eng: 0.1}), (1, 200, {eng: 0.0}), (2, 100, {eng: 0.2})], a)
    # rs_direct: kept (100 + 50 + 0) / 300; lag 0: 1; stale 50 / 200
    _cell(tmp_path, "rs_direct_k8_s1", [(0, 100, {dire: 0.0}), (1, 100, {dire: 0.5}), (3, 100, {dire: 1.0})], b)
    _cell(tmp_path, "tis_k8_s1", [(0, 100, {}), (1, 300, {})], a)  # no RS: every token trained
    _cell(tmp_path, "rs_engine_k8_s2", [(0, 100, {eng: 0.5})], a)  # seed 2 appears once an RS arm ran at it
    text = exp.report(tmp_path, figure=False)
    rows = [x for x in text.splitlines() if x.startswith("| ")]
    assert "| rs_engine_k8_s1 | engine factor pi_train@v / mu | bfloat16 | 0.925 / 0.900 / 0.933 | 5/8 |" in rows
    assert "| rs_direct_k8_s1 | whole ratio pi_old / mu | bfloat16 | 0.500 / 1.000 / 0.250 | 3/8 |" in rows
    assert "| tis_k8_s1 | no RS | bfloat16 | 1.000 / 1.000 / 1.000 | 5/8 |" in rows
    assert "| f32_rs_engine_k8_s1 | engine factor pi_train@v / mu | float32 | not run yet | — |" in rows
    assert "| rs_engine_k8_s2 | engine factor pi_train@v / mu | bfloat16 | 0.500 / 0.500 / — | 5/8 |" in rows
    assert "| rs_direct_k8_s2 | whole ratio pi_old / mu | bfloat16 | not run yet | — |" in rows
    assert "| rs_engine_k8_s1 vs rs_direct_k8_s1 | +25.0 ± 25.0 pts | 3 / 1 | 0.62 |" in rows  # p = 10/16
    assert "| rs_engine_k8_s1 vs tis_k8_s1 | +0.0 ± 0.0 pts | 0 / 0 | 1 |" in rows
    assert "| rs_direct_k8_s1 vs tis_k8_s1 | -25.0 ± 25.0 pts | 1 / 3 | 0.62 |" in rows
    assert "| f32_rs_engine_k8_s1 vs f32_rs_direct_k8_s1 | not run yet | — | — |" in rows
    assert "| rs_engine_k8_s2 vs tis_k8_s2 | not run yet | — | — |" in rows
    assert not any("_s3" in x for x in rows)
    # the main table's trained column reads the engine-factor RS metric too (mean over steps: 0.9, 1.0, 0.8)
    main = next(x for x in rows if x.startswith("| rs_engine_k8_s1 | 3 |"))
    assert "| 0.900 |" in main


def test_topp_table_by_hand(exp, tmp_path):
    trl_w, trl_min = "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min"
    rej_seq, rej_tok, nseq = ("rollout_corr/rollout_rs_seq_masked_fraction", "rollout_corr/rollout_rs_masked_fraction",
                              "rollout_corr/num_valid_seqs")
    isw, ismin = "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min"
    inv, kl = "rollout_corr/invalid_token_fraction", "rollout_corr/kl"
    a = [1, 1, 1, 0, 0, 1, 1, 0]
    b = [0, 0, 1, 1, 0, 0, 1, 0]  # a - b: +25 points, paired s.e. 25 points; 3 vs 1 discordant, McNemar p 10/16
    # TRL: weights 0.5 and 0.7 (mean 0.6); step 2's smallest ratio 0 = a masked sequence
    _cell(tmp_path, "topp_trl_is_k1_s1", [(0, 100, {trl_w: 0.5, trl_min: 0.2}), (0, 100, {trl_w: 0.7, trl_min: 0.0})],
          b)
    # ours without matching: sequences kept 1 - (10 * 0.5 + 30 * 0.1) / 40 = 0.8 (unweighted: 0.7);
    # tokens kept (100 * 0.6 + 300 * 0.7) / 400 = 0.675 (unweighted 0.65; the sequence fractions would give 0.8)
    _cell(tmp_path, "topp_decoupled_k1_s1",
          [(0, 100, {rej_seq: 0.5, nseq: 10, rej_tok: 0.4, isw: 0.8, ismin: 0.25, kl: 0.01}),
           (0, 300, {rej_seq: 0.1, nseq: 30, rej_tok: 0.3, isw: 1.0, ismin: 0.5, kl: 0.03})], a)
    # recompute: 20 % of step 1's completion tokens are support misses (invalid): 80 valid of 100, RS rejects none:
    # trained 0.8; step 2 has no valid sequence: it weighs 0 in "sequences kept" (not 1) and 0 tokens in "trained"
    _cell(tmp_path, "topp_recompute_k1_s1",
          [(0, 80, {rej_seq: 0.0, nseq: 10, rej_tok: 0.0, inv: 0.2, isw: 1.0, ismin: 0.9, kl: 0.002,
                    "rollout_corr/support_log_mass_mean": -0.02}),
           (0, 0, {rej_seq: 1.0, nseq: 0})], b)
    rows = [x for x in exp.report(tmp_path, figure=False).splitlines() if x.startswith("| topp_")]
    by = {r.split(" | ")[0][2:]: r.split(" | ")[2:] for r in rows}
    assert by["topp_trl_is_k1_s1"] == ["3/8", "—", "0.600 (min 0)",
                                       "not logged by TRL; smallest weight 0 on 1 of 2 steps", "not logged by TRL",
                                       "—", "— |"]
    assert by["topp_decoupled_k1_s1"] == ["5/8", "+25.0 ± 25.0 pts (3 / 1, p 0.62)", "0.900 (min 0.25)", "0.800",
                                          "0.675", "0.0200", "— |"]
    assert by["topp_recompute_k1_s1"] == ["3/8", "+0.0 ± 0.0 pts (0 / 0, p 1)", "1.000 (min 0.9)", "1.000", "0.800",
                                          "0.0020", "-0.0200 |"]
    assert by["topp_trl_is_k1_s2"][0] == "not run yet"  # seed 2 is planned: listed before it runs
    assert by["topp_decoupled_k1_s2"][0] == "not run yet"


def test_trained_fraction_refuses_a_step_without_a_valid_token_count(exp, tmp_path):
    grid = tmp_path / "policy_lag"  # the main grid: its report has issue 23's table, which weighs steps by tokens
    grid.mkdir()
    _cell(grid, "tis_k8_s1", [(0, 0, {"rollout_corr/invalid_token_fraction": 1.0})], [1, 0])
    with pytest.raises(ValueError, match="every completion token has an invalid log-prob"):
        exp.report(grid, figure=False)


def test_seed_table_pairs_arms_by_seed(exp):
    # trl_k1 seeds 1-3: 0.40, 0.50, 0.30; trl_k8 seeds 1, 2, 4: 0.30, 0.52, 0.9 (seed 4 has no on-policy partner)
    acc = {"trl_k1_s1": 0.40, "trl_k1_s2": 0.50, "trl_k1_s3": 0.30, "trl_k8_s1": 0.30, "trl_k8_s2": 0.52,
           "trl_k8_s4": 0.90}
    rows = exp.seed_table({n: {"after": {"accuracy": a}} for n, a in acc.items()})
    k8 = next(r for r in rows if r.startswith("| trl_k8 |"))
    # unpaired: means 0.5733 - 0.40 = +17.3 pts; s.e. sqrt(var(k8)/3 + var(k1)/3) = sqrt(0.09213/3 + 0.01/3) = 0.1845
    assert "+17.3 ± 18.5 pts (vs trl_k1)" in k8
    # paired by seed (seeds 1, 2 only): differences -0.10, +0.02 -> mean -4.0 pts, sd 0.0849, s.e. 0.06
    assert k8.endswith("| -4.0 ± 6.0 pts (2; sd 8.5) |")
    assert next(r for r in rows if r.startswith("| trl_k1 |")).endswith("| — | — |")
    one = exp.seed_table({"trl_k32_s1": {"after": {"accuracy": 0.166}}})
    assert one[-1] == "| trl_k32 | 1 | 16.6 (one seed: no sd) % | — | — |"


def test_control_table_by_hand(exp, tmp_path):
    a = [1, 1, 1, 0, 0, 1, 1, 0]
    b = [0, 0, 1, 1, 0, 0, 1, 0]  # a - b: +25 points, paired s.e. 25 points; 3 vs 1 discordant: p = 10/16
    k = exp.GRID_K
    _cell(tmp_path, f"bypass_k{k}_s1", [(1, 10, {"rollout_corr/kl": 0.1, "grad_norm": 1.0}),
                                        (2, 10, {"rollout_corr/kl": 0.3, "grad_norm": 0.5})], a)
    _cell(tmp_path, f"trl_slow_k{k}_s1", [(1, 10, {"rollout_corr/kl": 2.0, "grad_norm": 3.0})], b)
    _cell(tmp_path, "trl_k1_s1", [(0, 10, {})], a)
    _cell(tmp_path, f"trl_k{k}_s1", [(1, 10, {})], b)  # plain TRL is the main table's reference, not a row here
    _cell(tmp_path, f"tis_k{k}_s2", [(1, 10, {"rollout_corr/kl": 0.5, "grad_norm": 1.5})], b)  # no controls yet
    _cell(tmp_path, "tis_k8_s1", [(1, 10, {})], a)  # another k: not a row
    rows = exp.control_table({c.name: exp.summarize(c) for c in tmp_path.iterdir()})
    body = [r for r in rows if r.startswith("| ") and not r.startswith("| cell")]
    assert sorted(body) == sorted([
        f"| bypass_k{k}_s1 | 5/8 | 0.200 | 0.750 | +25.0 ± 25.0 pts (p 0.62) | +0.0 ± 0.0 pts (p 1) |",
        f"| trl_slow_k{k}_s1 | 3/8 | 2.000 | 3.000 | — | -25.0 ± 25.0 pts (p 0.62) |",
        f"| tis_k{k}_s2 | 3/8 | 0.500 | 1.500 | not run yet | not run yet |",
    ])
    assert exp.control_table({}) == []
    assert f"| bypass_k{k}_s1 | 5/8 |" in exp.report(tmp_path, figure=False)  # the report carries the table
    # a vendor grid plans no trl_slow: its column says so instead of promising a run
    cells = {c.name: exp.summarize(c) for c in tmp_path.iterdir()}
    vendor = exp.control_table(cells, exp.VENDOR_ORDER)
    assert f"| tis_k{k}_s2 | 3/8 | 0.500 | 1.500 | not in this grid's plan | not run yet |" in vendor


def _step(step, lag, kl=None, dropped=0.0):
    r = {"step": step, "loss": 0.0, "step_time": 1.0, "rollout_corr/policy_lag_max": lag,
         "rollout_corr/policy_lag_mean": lag, "rollout_corr/policy_lag_dropped_fraction": dropped}
    if kl is not None:
        r["rollout_corr/k3_kl"] = kl
    return r


def test_lag_check_passes_steps_whose_samples_the_lag_filter_dropped(exp):
    # direct_gate at k = 4 with max_policy_lag 2: lags 0..3 in a window, lag 3 dropped whole (no kept token -> no kl)
    log = [_step(1, 0, 0.004), _step(2, 1, 0.08), _step(3, 2, 0.15), _step(4, 3, dropped=1.0),
           _step(5, 0, 0.005), _step(6, 1, 0.09)]
    assert exp.lag_check("direct_gate_k4_s1", log, engine_kl_max=0.02) == []


def test_lag_check_still_fails_real_violations(exp):
    log = [_step(1, 0, 0.004), _step(2, 1), _step(3, 4, 0.2, dropped=1.0), _step(4, 0, 0.05),
           _step(5, 1, 0.1, dropped=0.5), _step(6, 2, 0.1), _step(7, 3, 0.1), _step(8, 1, 0.1)]
    assert exp.lag_check("tis_k4_s1", log, engine_kl_max=0.02) == [
        "step 2: no policy_lag_max / k3_kl logged",  # kl missing although samples were kept
        "step 3: policy_lag_max 4 outside [0, 3]",
        "step 4: lag 0 but k3_kl 0.0500 > 0.02 (engine level)",
        "step 8: no lag-0 step in the last 4 steps",
    ]


def test_cpu_fingerprint_reads_model_and_vector_flags(exp):
    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16\n")
    assert exp.cpu_fingerprint(info) == {"model": "AMD EPYC", "vendor_id": "AuthenticAMD", "avx2": True,
                                         "avx512f": True, "avx512_bf16": True}
    assert exp.cpu_fingerprint("model name\t: Old\nflags\t: sse2 avx avx2\n") == {
        "model": "Old", "vendor_id": "", "avx2": True, "avx512f": False, "avx512_bf16": False}


def test_avx2_kernel_pin_selects_avx2_in_a_fresh_process(exp):
    """benchmarks/avx2_kernels/sitecustomize.py, as the runner passes it to a cell: ATen on AVX2 and vLLM's
    AVX-512 probes off, on a CPU that has AVX2 (skipped on one that has not: nothing to pin there)."""
    import subprocess
    import sys

    if not exp.cpu_fingerprint().get("avx2"):
        pytest.skip("this CPU has no AVX2")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("ATEN_CPU_CAPABILITY",)}
    env["PYTHONPATH"] = str(exp.AVX2_KERNELS)
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability(), "
                          "torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AVX2", "False", "False"]


def _meta(folder: Path, model: str | None) -> None:
    import json

    folder.mkdir(parents=True)
    (folder / "cell_meta.json").write_text(json.dumps({"cpu": {"model": model}} if model is not None else {}))


def test_grid_vendor_and_the_refusal_on_another_vendor(exp, tmp_path):
    assert exp.cpu_vendor("AMD EPYC 9R14") == "AMD"
    assert exp.cpu_vendor("Intel(R) Xeon(R) Processor") == "Intel"
    assert exp.cpu_vendor("") is None and exp.cpu_vendor("Hygon C86") is None
    assert exp.cpu_vendor("QEMU Virtual CPU", "GenuineIntel") == "Intel"  # vendor_id wins over a generic name
    assert exp.cpu_vendor("Intel(R) Xeon(R)", "AuthenticAMD") == "AMD"
    grid = tmp_path / "policy_lag"
    assert exp.grid_vendor(grid) is None  # no folder yet: a new grid, any vendor may start it
    _meta(grid / "warmstart", None)  # a cell from before the cpu field: unknown, not a vote
    assert exp.grid_vendor(grid) is None
    exp.check_vendor(grid, here="Intel")  # nothing committed says a vendor: runs
    _meta(grid / "tis_k1_s1", "AMD EPYC")
    assert exp.grid_vendor(grid) == "AMD"
    exp.check_vendor(grid, here="AMD")
    with pytest.raises(RuntimeError, match="run on AMD CPUs and this machine's is Intel.*policy_lag_intel"):
        exp.check_vendor(grid, here="Intel")
    with pytest.raises(RuntimeError, match="this machine's is unknown"):
        exp.check_vendor(grid, here="")  # a vendor cpu_vendor does not know
    (grid / "trl_k8_s1").mkdir()  # a VM's generic name: its vendor_id decides
    (grid / "trl_k8_s1" / "cell_meta.json").write_text('{"cpu": {"model": "QEMU", "vendor_id": "AuthenticAMD"}}')
    assert exp.grid_vendor(grid) == "AMD"
    _meta(grid / "trl_k1_s1", "Intel(R) Xeon(R) Processor")
    with pytest.raises(RuntimeError, match=r"several vendors \(\['AMD', 'Intel'\]\)"):
        exp.grid_vendor(grid)


def test_each_grid_reports_into_its_own_section(exp, tmp_path):
    assert exp.markers(tmp_path / "policy_lag") == (exp.BEGIN, exp.END)
    begin, end = exp.markers(tmp_path / "policy_lag_intel")
    assert begin == "<!-- BEGIN policy_lag_experiment.py output: policy_lag_intel -->"
    assert end == "<!-- END policy_lag_experiment.py output: policy_lag_intel -->"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"head\n{exp.BEGIN}\nmain grid\n{exp.END}\ntail\n")
    exp.replace_section(f"{begin}\nintel grid\n{end}", begin, end, results)
    exp.replace_section(f"{exp.BEGIN}\nmain grid v2\n{exp.END}", exp.BEGIN, exp.END, results)
    text = results.read_text()
    assert "main grid v2" in text and "intel grid" in text and "main grid\n" not in text
    empty = exp.report(tmp_path / "policy_lag_intel", figure=False)
    assert empty.startswith(begin) and empty.endswith(end)
    assert "grid `benchmarks/results/policy_lag_intel`" in empty


def test_a_vendor_grid_plans_the_missing_cells_with_their_references_first(exp, tmp_path):
    assert exp.plan(tmp_path / "policy_lag") == exp.ORDER
    order = exp.plan(tmp_path / "policy_lag_intel")
    assert order[:5] == ["warmstart", "trl_k8_s1", "bypass_k8_s1", "trl_k1_s1", "tis_k8_s1"]
    assert len(order) == len(set(order)) == 1 + 18 + 6
    for name in order[1:]:  # every cell's paired reference is in the plan, within the same seed's block of cells
        ref = exp.reference_cell(name)
        if ref is not None:
            assert ref in order and exp.parse_cell(ref)[2] == exp.parse_cell(name)[2], name
    assert exp.reference_cell("trl_k1_s1") is None and "trl_k1_s1" in order  # the lag reference has none itself


def test_accuracy_figure_series_splits_the_lag_grid_from_the_controls(exp):
    acc = {"warmstart": 0.30, "trl_k1_s1": 0.40, "trl_k8_s2": 0.25, "trl_k8_s1": 0.20, "bypass_k8_s1": 0.50,
           "topp_trl_is_k1_s1": 0.24, "topp_recompute_k1_s2": 0.10, "f32_rs_engine_k8_s1": 0.16}
    series = exp.accuracy_series({n: {"after": {"accuracy": a}} for n, a in acc.items()})
    # the lag panel: methods at top_p 1 with the bf16 engine, accuracies per k in seed order (s1 before s2)
    assert series[exp.LAG_PANEL] == {"bypass": {8: [0.50]}, "trl": {1: [0.40], 8: [0.20, 0.25]}}
    # top-p and float32-engine cells are controls, each at its own k; the warm start is no method
    assert series[exp.CONTROL_PANEL] == {"f32_rs_engine": {8: [0.16]}, "topp_recompute": {1: [0.10]},
                                         "topp_trl_is": {1: [0.24]}}
    # every method the runner knows has a fixed style, so no two methods of one figure share colour and marker
    assert set(exp.METHODS) <= set(exp.METHOD_STYLE)
    panel = [exp.METHOD_STYLE[m] for m in exp.METHODS if not m.startswith(("topp_", "f32_"))]
    assert len(set(panel)) == len(panel)


def test_curve_series_averages_each_arm_over_the_seeds_that_logged_the_step(exp):
    def cell(steps, trained=None, curve=(), after=None):
        return {"steps": steps, "trained": trained or [1.0] * len(steps), "curve": list(curve), "after": after}

    cells = {
        "warmstart": cell([{"step": 1, "kl": 9.0}]),
        # trl_k1: two seeds; seed 2 logged no kl at step 2 and a NaN at step 3, so those steps average seed 1 alone
        "trl_k1_s1": cell([{"step": 1, "kl": 0.1}, {"step": 2, "kl": 0.3}, {"step": 3, "kl": 0.5}], [1.0, 0.5, 0.0]),
        "trl_k1_s2": cell([{"step": 1, "kl": 0.3}, {"step": 2}, {"step": 3, "kl": float("nan")}], [0.0, 0.5, 1.0]),
        # bypass at k = 32 (GRID_K): one seed, its check curve plus the final score on the same 4 first items
        "bypass_k32_s1": cell([{"step": s, "kl": 0.2} for s in (1, 2, 3, 4)],
                              curve=[{"step": 0, "correct": 1, "total": 4}, {"step": 2, "correct": 2, "total": 4}],
                              after={"scores": [1, 1, 1, 0, 0, 0], "accuracy": 0.5}),
        "tis_k8_s1": cell([{"step": 1}, {"step": 2}]),  # logged no kl: no line at all for it
        "trl_k4_s1": cell([{"step": 1, "kl": 7.0}]),  # k not in CURVE_KS
        "topp_trl_is_k1_s1": cell([{"step": 1, "kl": 7.0}]),  # a control, not a lag arm
        "f32_rs_engine_k8_s1": cell([{"step": 1, "kl": 7.0}]),
    }
    kl = exp.curve_series(cells, "kl")
    assert kl == {("trl", 1): {1: pytest.approx(0.2), 2: 0.3, 3: 0.5},
                  ("bypass", 32): {1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2}}
    assert exp.curve_series(cells, None)[("trl", 1)] == {1: 0.5, 2: 0.5, 3: 0.5}
    assert exp.curve_series(cells, "curve") == {("bypass", 32): {0: 0.25, 2: 0.5, 4: 0.75}}


def test_anchor_controls_carry_their_step_size_or_kl_penalty_and_replay_plain_trl(exp, tmp_path):
    """Issue 47's k = 32 controls: plain TRL at lr / 4 and lr / 8, or with TRL's KL penalty to the start (beta 0.1,
    1.0); their rollout key equals plain TRL's of the same seed, so they replay its recorded rollouts."""
    import argparse

    args = argparse.Namespace(out=str(tmp_path), lr=3e-5, steps=32, prompts=8, warmstart_steps=16)

    def kv(cell):
        f = exp.cell_flags(cell, tmp_path / cell, args)
        return f, dict(zip(f[::2], f[1::2]))

    expected = {"trl_lr4_k32_s2": ("7.5e-06", None), "trl_lr8_k32_s2": ("3.75e-06", None),
                "trl_beta01_k32_s2": ("3e-05", "0.1"), "trl_beta1_k32_s2": ("3e-05", "1.0"),
                "trl_slow_k32_s2": ("1.5e-05", None), "trl_k32_s2": ("3e-05", None)}
    for cell, (lr, beta) in expected.items():
        f, d = kv(cell)
        assert (d["--learning_rate"], d.get("--beta"), d["--vllm_importance_sampling_correction"]) == \
            (lr, beta, "false"), cell
        assert d["--config"].endswith("cpu_smollm2_no_correction.yaml")
        assert exp.rollout_key(f) == exp.rollout_key(kv("trl_k32_s2")[0]), cell
        assert exp.reference_cell(cell) == ("trl_k32_s2" if cell != "trl_k32_s2" else "trl_k1_s2")


def _issue47_cell(root, name, k3, after, checks, k1=None, trl_kl=None):
    """A never-synced synthetic cell for issue 47's tables: lags 0, 1, ... per step, ``k3`` the per-step
    ``rollout_corr/k3_kl`` (K1 ``rollout_corr/kl``: ``k1`` or equal to it; TRL's ``kl``: ``trl_kl`` where given),
    final scores ``after`` and the 4-item checks ``checks`` = [(step, scores)]."""
    import json

    steps = [(lag, 10, {"rollout_corr/k3_kl": v, "rollout_corr/kl": v if k1 is None else k1,
                        **({"kl": trl_kl} if trl_kl is not None else {})}) for lag, v in enumerate(k3)]
    _cell(root, name, steps, after)
    (root / name / "curve.jsonl").write_text("".join(json.dumps({"step": s, "scores": sc}) + "\n" for s, sc in checks))


def _issue47_grid(root):
    """The warm start 3/8 (its 4 check items [1, 0, 1, 0]: area 0.5) and k = 32 cells of 5 steps, checks at 0 and 2."""
    ws4 = [1, 0, 1, 0]
    _issue47_cell(root, "warmstart", [0.001], [1, 0, 1, 0, 0, 0, 1, 0], [(0, [0, 0, 0, 0])])
    k = 32
    # the frontier arms of seed 1: (KL 2, final 1/8, area 0.3), (KL 1, 3/8, 0.5), (KL 3, 0/8, 0.1)
    _issue47_cell(root, f"trl_k{k}_s1", [0.001, 2, 2, 2, 2], [0, 0, 1, 0, 0, 0, 0, 0], [(0, ws4), (2, [0, 0, 1, 0])])
    _issue47_cell(root, f"trl_lr4_k{k}_s1", [0.001, 1, 1, 1, 1], [1, 0, 1, 0, 0, 0, 1, 0], [(0, ws4), (2, ws4)])
    _issue47_cell(root, f"trl_beta1_k{k}_s1", [0.001, 3, 3, 3, 3], [0] * 8, [(0, ws4), (2, [0, 0, 0, 0])], trl_kl=0.2)
    # bypass: seed 1 at KL 0.4 (item areas 1, 0.8, 1, 0: 0.7), seed 2 (0.9) has no frontier arm, seed 3 fails the
    # lag check (k3_kl 0.5 at its lag-0 step)
    _issue47_cell(root, f"bypass_k{k}_s1", [0.001, 0.4, 0.4, 0.4, 0.4], [1, 1, 1, 0, 1, 0, 1, 0],
                  [(0, ws4), (2, [1, 1, 1, 0])], k1=0.35)
    _issue47_cell(root, f"bypass_k{k}_s2", [0.001, 0.4, 0.4, 0.4, 0.4], [1, 1, 1, 1, 1, 0, 1, 0],
                  [(0, ws4), (2, [1, 1, 1, 1])])
    _issue47_cell(root, f"bypass_k{k}_s3", [0.5, 0.4, 0.4, 0.4, 0.4], [0] * 8, [(0, ws4), (2, [0, 0, 0, 0])])


def test_issue47_reanalysis_by_hand(exp, tmp_path):
    grid = tmp_path / "policy_lag"
    grid.mkdir()
    _issue47_grid(grid)
    text = exp.report(grid, figure=False)
    rows = [x for x in text.splitlines() if x.startswith("| ")]
    assert "lag check failed): bypass_k32_s3 (step 1: lag 0 but k3_kl 0.5000 > 0.03 (engine level))." in text
    # per cell against the warm start, paired per item: final differences 0,1,0,0,1,0,0,0 (mean 0.25, se
    # sqrt(1.5 / 7 / 8) = 0.1637, t(0.975, 7) = 2.3646: half 0.387); area items 1, 0.8, 1, 0 minus 1, 0, 1, 0 (mean
    # 0.2, sd 0.4, se 0.2, t(0.975, 3) = 3.1824: half 0.636)
    assert "| bypass_k32_s1 | 62.5 | +25.0 [-13.7, +63.7] | 70.0 | +20.0 [-43.6, +83.6] | passed |" in rows
    assert any(r.startswith("| bypass_k32_s3 | 0.0 |") and r.endswith("| FAILED (left out of pooled figures) |")
               for r in rows)
    # per arm over the seeds that passed (1, 2): finals 5/8, 6/8 minus 3/8 = 0.25, 0.375 (t(0.975, 1) = 12.706, se
    # 0.0625, t = 5: p 0.126); areas 0.7, 0.9 minus 0.5 = 0.2, 0.4 (se 0.1, t = 3: p 0.205)
    assert "| bypass_k32 | 2 (1) | 68.8 | +31.2 [-48.2, +110.7], p 0.13 | 80.0 | +30.0 [-97.1, +157.1], p 0.2 |" \
        in rows
    assert any(r.startswith("| bypass_k32 (incl. failed cells) | 3 (2) | 45.8 |") for r in rows)  # both ways
    # paired by seed: only seed 1 has plain TRL; final 5/8 - 1/8, area 0.7 - 0.3
    assert "| bypass_k32 - trl_k32 | 1 (0) | +50.0 (n = 1: no interval) | 1/1 | +40.0 (n = 1: no interval) |" in rows
    # the anchor table: seed 1's frontier (0, 3/8), (1, 3/8), (2, 1/8), (3, 0) is 3/8 at KL 0.4 (area: 0.5)
    assert "| warmstart | 0.000 | 0.000 | — | 37.5 | 50.0 | start | start |" in rows
    assert "| bypass_k32_s1 | 0.400 | 0.350 | — | 62.5 | 70.0 | +25.0 | +20.0 |" in rows
    assert "| bypass_k32_s2 | 0.400 | 0.400 | — | 75.0 | 90.0 | — | — |" in rows  # no frontier arm at seed 2
    assert "| trl_beta1_k32_s1 | 3.000 | 3.000 | 0.200 | 0.0 | 10.0 | frontier | frontier |" in rows  # TRL's kl
    assert not any(r.startswith("| bypass_k32_s3 | 0.400") for r in rows)  # the failed cell is no anchor point
    assert "| bypass | 1 | +25.0 (n = 1: no interval) | +20.0 (n = 1: no interval) |" in rows
    line = next(x for x in text.splitlines() if x.startswith("Frontier arms not run yet: "))
    missing = set(line.removeprefix("Frontier arms not run yet: ").rstrip(".").split(", "))
    planned = {c for c in exp.ORDER[1:] if exp.parse_cell(c)[0] in exp.FRONTIER_ARMS and exp.parse_cell(c)[1] == 32}
    assert missing == planned - {"trl_k32_s1", "trl_lr4_k32_s1", "trl_beta1_k32_s1"}  # the committed ones are not
    assert {"trl_lr4_k32_s2", "trl_beta01_k32_s1", "trl_slow_k32_s2", "trl_k32_s3"} <= missing


def test_issue47_comparisons_pair_each_arm_with_its_references(exp):
    arms = {a: {} for a in [("bypass", 32), ("trl", 32), ("trl_beta1", 32), ("trl_lr4", 32), ("bypass", 8),
                            ("trl", 8), ("trl", 1), ("bypass", 1), ("trl_slow", 32), ("topp_decoupled", 1),
                            ("topp_trl_is", 1)]}
    pairs = exp.arm_comparisons(arms)
    assert [p for p in pairs if p[0] == ("bypass", 32)] == [
        (("bypass", 32), ("trl", 32)), (("bypass", 32), ("bypass", 1)), (("bypass", 32), ("trl", 1)),
        (("bypass", 32), ("trl_slow", 32)), (("bypass", 32), ("trl_lr4", 32)), (("bypass", 32), ("trl_beta1", 32))]
    assert [p for p in pairs if p[0] == ("bypass", 8)] == [
        (("bypass", 8), ("trl", 8)), (("bypass", 8), ("bypass", 1)), (("bypass", 8), ("trl", 1))]
    assert [p for p in pairs if p[0][0] == "trl"] == [(("trl", 8), ("trl", 1)), (("trl", 32), ("trl", 1))]
    assert (("trl_lr4", 32), ("trl", 32)) in pairs and (("trl_lr4", 32), ("trl_slow", 32)) in pairs
    assert (("topp_decoupled", 1), ("topp_trl_is", 1)) in pairs
    assert not any(b == ("trl_slow", 32) and a == ("trl_slow", 32) for a, b in pairs)


def test_issue47_a_vendor_grid_without_anchor_arms_says_its_frontier_is_plain_trl_alone(exp, tmp_path):
    no_controls = "This grid plans no step-size or anchor arm"
    main, vendor = tmp_path / "policy_lag", tmp_path / "policy_lag_intel"
    for grid in (main, vendor):
        grid.mkdir()
        _issue47_grid(grid)
    assert no_controls not in exp.report(main, figure=False)
    text = exp.report(vendor, figure=False)
    assert no_controls in text and "Frontier arms not run yet: trl_k32_s2, trl_k32_s3." in text  # plain TRL only
    assert "| bypass_k32_s1 | 0.400 | 0.350 | — | 62.5 | 70.0 | +25.0 | +20.0 |" in text  # the committed cells count


def test_commit_cell_commits_each_folder_alone_when_two_runners_meet(tmp_path):
    """Two runners side by side (``async_lag_grid.py --cells``) commit at once: the lock serialises them, each
    commit holds its own cell only, and a file staged by someone else is not taken along."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    pl = load_script("benchmarks/policy_lag_experiment.py")

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    (tmp_path / "README").write_text("x\n")
    git("add", "README"), git("commit", "-q", "-m", "init")
    results = tmp_path / "results" / "cand"
    for i in range(6):
        (results / f"c{i}").mkdir(parents=True)
        (results / f"c{i}" / "eval.json").write_text(f"{i}\n")
    (tmp_path / "other").write_text("staged elsewhere\n")
    git("add", "other")
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda i: pl.commit_cell(results, f"c{i}", f"cell {i}"), range(6)))
    commits = []
    for line in filter(None, git("log", "--format=@%s", "--name-only").splitlines()):
        if line.startswith("@"):
            commits.append([line[1:]])
        else:
            commits[-1].append(line)
    commits = [c for c in commits if c[0].startswith("results:")]
    assert sorted(c[1] for c in commits) == [f"results/cand/c{i}/eval.json" for i in range(6)]
    assert all(len(c) == 2 for c in commits)
    assert "other" in git("diff", "--cached", "--name-only")
