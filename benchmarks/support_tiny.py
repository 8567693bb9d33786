"""Engine ratios on a tiny random Llama, float32 on both sides (the numerics agree, so what is left is the support):
top_p 0.8, top_k 20 and min_p 0.1, each without support matching and with it (recompute, replay), on the
``transformers.generate`` path of ``RolloutCorrGRPOTrainer``. Also: a generation config that TRL's log-probs do not
follow (``generation_kwargs`` temperature 0.7 and top_k 20, ``generation_config.json`` min_p 0.1 and
no_repeat_ngram_size 2), without matching and with replay.

Per setting: 4 generation batches of 16 completions (<= 8 tokens); mean engine ratio pi_old / mu, max |log ratio|,
``rollout_corr/kl`` (mean log mu - log pi_old) and the mean log kept mass. The same checks, with thresholds, are in
``tests/features/test_trainer_support.py``.

    PYTHONPATH=. .venv/bin/python benchmarks/support_tiny.py [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

BEGIN = "<!-- BEGIN support_tiny.py output -->"
END = "<!-- END support_tiny.py output -->"
PROMPTS = [{"prompt": p} for p in ("1+3=", "2+4=", "3+5=", "4+6=")] * 4


def measure(model_dir: str, matching: str, batches: int, **config) -> dict:
    from conftest import _make_trainer

    trainer = _make_trainer(model_dir, Path(tempfile.mkdtemp()), rollout_support_matching=matching, **config)
    trainer.model.eval()
    log_ratios, log_mass = [], []
    for _ in range(batches):
        out = trainer._generate_and_score_completions(PROMPTS)
        valid = out["completion_mask"].bool()
        log_ratios.append((out["old_per_token_logps"] - out["rollout_log_probs"])[valid])
        log_mass.append(trainer.rollout_corr_metrics.flush("eval").get("eval_rollout_corr/support_log_mass_mean"))
    l = torch.cat(log_ratios).double()
    return {"ratio_mean": float(l.exp().mean()), "max_abs_log_ratio": float(l.abs().max()), "kl": float(-l.mean()),
            "log_mass": None if log_mass[0] is None else sum(log_mass) / len(log_mass), "tokens": l.numel()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tiny_model import make_tiny_model_dir

    root = tempfile.mkdtemp()
    model_dir = make_tiny_model_dir(f"{root}/plain", "llama")
    shaped = make_tiny_model_dir(f"{root}/shaped", "llama")
    gen = Path(shaped, "generation_config.json")
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "min_p": 0.1, "no_repeat_ngram_size": 2}))
    rows = []
    for sampler in (dict(top_p=0.8), dict(top_k=20), dict(min_p=0.1)):
        for matching in ("off", "recompute", "replay"):
            rows.append((str(sampler), matching, measure(model_dir, matching, args.batches, **sampler)))
            print(rows[-1], flush=True)
    shaped_kwargs = dict(generation_kwargs={"temperature": 0.7, "top_k": 20})
    for matching in ("off", "replay"):
        rows.append(("generation_kwargs temperature 0.7, top_k 20 + generation_config.json min_p 0.1, "
                     "no_repeat_ngram_size 2", matching, measure(shaped, matching, args.batches, **shaped_kwargs)))
        print(rows[-1], flush=True)
    lines = [BEGIN, "", "### Support matching on a tiny model, float32 on both sides (`benchmarks/support_tiny.py`)",
             "", f"Tiny random Llama (vocabulary 43), `transformers.generate` path, {args.batches} generation batches "
             "of 16 completions (<= 8 tokens), temperature 1 unless stated. Engine ratio = pi_old / mu per token.", "",
             "| sampler | matching | tokens | mean engine ratio | max abs log ratio | rollout_corr/kl | mean log S |",
             "|---|---|---|---|---|---|---|"]
    for sampler, matching, r in rows:
        log_mass = "n/a (off)" if r["log_mass"] is None else f"{r['log_mass']:.4f}"
        lines.append(f"| {sampler} | {matching} | {r['tokens']} | {r['ratio_mean']:.6f} "
                     f"| {r['max_abs_log_ratio']:.2e} | {r['kl']:.4f} | {log_mass} |")
    lines += ["", END]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
