"""``trl-rollout-corr probe`` (probe.py): the sampler-support rule, the statistics and TRL's batch layout by hand, and
the probe end to end with the ``transformers`` engine on the tiny model (the vLLM run is in
tests/e2e/test_vllm_cpu.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from trl_rollout_corr import probe
from trl_rollout_corr.cli import main
from trl_rollout_corr.console import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK


# ---------------------------------------------------------------------------------------------- by hand
@pytest.mark.unit
def test_kept_support_follows_each_engines_order():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()

    def kept(order, **kw):
        args = dict(top_k=0, top_p=1.0, min_p=0.0) | kw
        return probe.kept_support(logits, order=order, **args)[0].tolist()

    # top-p 0.8: the mass before token 1 is 0.5 < 0.8 (kept), before token 2 it is 0.8 (dropped)
    assert kept("vllm", top_p=0.8) == [True, True, False, False]
    assert kept("vllm", top_k=3) == [True, True, True, False]
    assert kept("vllm", min_p=0.2) == [True, True, True, False]  # p >= 0.2 * 0.5
    # top_p 0.6 + min_p 0.5: transformers (top-p first) keeps {0, 1}: renormalised 0.375 >= 0.5 * 0.625;
    # vLLM (min-p first) keeps {0, 1} then top-p on [0.625, 0.375] keeps only token 0
    assert kept("transformers", top_p=0.6, min_p=0.5) == [True, True, False, False]
    assert kept("vllm", top_p=0.6, min_p=0.5) == [True, False, False, False]
    assert kept("vllm") == [True] * 4


@pytest.mark.unit
def test_log_ratio_stats_by_hand():
    x = torch.tensor([0.0, math.log(2.0), -math.log(2.0), 0.05, float("nan")], dtype=torch.float64)
    s = probe.log_ratio_stats(x, [(0.9, 1.1), (0.5, 2.0)])
    assert s["tokens"] == 4 and s["non_finite"] == 1
    assert s["mean_abs"] == pytest.approx((2 * math.log(2) + 0.05) / 4)
    assert s["max_abs"] == pytest.approx(math.log(2))
    assert s["mean_ratio"] == pytest.approx((1 + 2 + 0.5 + math.exp(0.05)) / 4)
    assert s["out_of_band"] == {"0.9_1.1": 0.5, "0.5_2": 0.0}  # the band is inclusive
    assert probe.log_ratio_stats(torch.zeros(0), [(0.9, 1.1)])["mean_abs"] == 0.0
    rows = probe.by_bucket(x[:4].double(), torch.tensor([0, 1, 2, 3]), (1, 2), (0.9, 1.1))
    assert [(r["bucket"], r["tokens"]) for r in rows] == [("0", 1), ("1", 1), (">=2", 2)]
    assert rows[2]["out_of_band"] == 0.5
    assert probe.bucket_labels((1, 2, 4, 8)) == ["0", "1", "2-3", "4-7", ">=8"]


@pytest.mark.unit
def test_trl_layout_pads_prompts_left_and_completions_right():
    samples = [probe.Sample(0, [5, 6], [7, 8, 9], [0.0] * 3), probe.Sample(1, [4, 5, 6], [1], [0.0])]
    ids, mask, T = probe.trl_layout(samples, pad_token_id=0)
    assert T == 3
    assert ids.tolist() == [[0, 5, 6, 7, 8, 9], [4, 5, 6, 1, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]


@pytest.mark.unit
def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert probe.load_prompts(str(f), 5) == ["hi", [{"role": "user", "content": "yo"}]]
    f.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(probe.ProbeError, match=r"p.jsonl:2: expected a JSON object with 'prompt'"):
        probe.load_prompts(str(f), 5)
    txt = tmp_path / "p.txt"
    txt.write_text("one\ntwo\nthree\n")
    assert probe.load_prompts(str(txt), 2) == ["one", "two"]
    txt.write_text("\n")
    with pytest.raises(probe.ProbeError, match="no prompt in the file"):
        probe.load_prompts(str(txt), 2)
    assert len(probe.load_prompts(None, 3)) == 3


# ---------------------------------------------------------------------------------------------- end to end
def _args(model_dir, out, **kw):
    argv = ["probe", "--model", str(model_dir), "--engine", "transformers", "--num-prompts", "3",
            "--samples-per-prompt", "2", "--max-tokens", "6", "--train-batch-size", "4", "--threads", "1",
            "--no-plots", "--out", str(out)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv


def test_probe_transformers_engine_end_to_end(llama_dir, tmp_path, capsys):
    assert main(_args(llama_dir, tmp_path / "fp32", rollout_dtype="float32", train_dtype="float32")) == EXIT_OK
    fp32 = json.loads((tmp_path / "fp32" / "report.json").read_text())
    out = capsys.readouterr().out
    assert "self-consistency (batch 1 vs 4, float32)" in out and "Most mismatched tokens" in out
    # float32 generate (KV cache) vs the float32 training forward: rounding-level differences only
    assert fp32["tokens"] > 10 and fp32["log_ratio"]["max_abs"] < 1e-4
    assert fp32["self_consistency"]["max_abs"] < 1e-4 and fp32["truncation"] is None
    assert fp32["fp32_lm_head"]["train"].startswith("n/a")
    assert len(fp32["top_tokens"]) == 10 and "[[" in fp32["top_tokens"][0]["context"]
    assert sum(r["tokens"] for r in fp32["by_position"]) == fp32["tokens"]

    # a bf16 sampler with top-p: a real mismatch, the truncation term, and --fail-above exits 1
    code = main(_args(llama_dir, tmp_path / "bf16", rollout_dtype="bfloat16", train_dtype="bfloat16", top_p=0.9,
                      fail_above=1e-4))
    bf16 = json.loads((tmp_path / "bf16" / "report.json").read_text())
    assert code == EXIT_CHECK_FAILED and bf16["fail"]["failed"] and bf16["fail"]["value"] > 1e-4
    assert bf16["log_ratio"]["mean_abs"] > 10 * fp32["log_ratio"]["mean_abs"]
    t = bf16["truncation"]
    assert t["processor_order"] == "transformers" and -0.5 < t["log_kept_mass_mean"] < 0.0
    # top-p's log S is a bias the full-vocabulary score cannot see: matching the support removes most of it
    matched = bf16["variants"]["engine_vs_train_support_matched"]
    assert abs(matched["mean"]) < abs(bf16["log_ratio"]["mean"])
    assert "engine_vs_train_fp32_head" in bf16["variants"]  # bf16 trainer: TRL's cast_lm_head_to_fp32 measured
    assert bf16["fp32_lm_head"]["rollout"].startswith("n/a: transformers.generate")


def test_probe_bad_input(llama_dir, tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("not json\n")
    code = main(_args(llama_dir, tmp_path / "o", rollout_dtype="float32", train_dtype="float32", prompts=bad))
    assert code == EXIT_BAD_INPUT and "prompts.jsonl:1: expected a JSON object" in capsys.readouterr().err
    code = main(_args(tmp_path, tmp_path / "o", rollout_dtype="float32", train_dtype="float32"))
    assert code == EXIT_BAD_INPUT and "no config.json there" in capsys.readouterr().err
    (tmp_path / "o").mkdir(exist_ok=True)
    (tmp_path / "o" / "report.json").write_text("{}")
    code = main(_args(llama_dir, tmp_path / "o", rollout_dtype="float32", train_dtype="float32"))
    assert code == EXIT_BAD_INPUT and "report.json already exists" in capsys.readouterr().err
    assert (tmp_path / "o" / "report.json").read_text() == "{}"
    with pytest.raises(SystemExit):  # argparse: --rollout-dtype is required (never "auto")
        main(["probe", "--model", str(llama_dir), "--engine", "vllm", "--train-dtype", "float32"])
    assert probe.fail_value({"log_ratio": {"out_of_band": {"0.9_1.1": 0.25}}}, "out_of_band") == 0.25
    ns = argparse.Namespace(model=str(llama_dir), num_prompts=1, samples_per_prompt=1, max_tokens=1,
                            train_batch_size=1, temperature=1.0, top_p=1.5, top_k=0, min_p=0.0)
    with pytest.raises(probe.ProbeError, match=r"--top-p 1.5 is out of range"):
        probe._check_args(ns)
