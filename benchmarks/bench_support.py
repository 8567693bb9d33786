"""Peak memory and CPU time of the support-matched log-probs at SmolLM2's head (V = 49152, H = 576), vs TRL's fused
head and vs materialising the logits.

For each (rows B, prompt P, completion T) the script runs, each in a fresh subprocess (so ``ru_maxrss`` is that
computation's own peak), on one thread:

* ``trl_head``: TRL 1.16's ``ChunkedLogProbFunction`` (its fused LM head, log-prob + entropy) forward + backward
  over every position of the B x (P + T - 1) batch, as TRL scores on a device without Triton;
* ``support_fwd``: ``support.SupportScorer`` (recompute, the sampler in ``--sampler``) forward only, no grad (the
  pi_old forward), over the B x T completion positions;
* ``support_fwd_bwd``: the same with grad, forward + backward (the pi_theta forward of the loss);
* ``dense``: ``log_softmax`` of the full (B, T, V) logits with top-p applied the plain way, forward + backward
  (what a direct implementation would hold), only where it fits in ``--dense-limit-gib``.

Hidden states and head weights are random, scaled so the next-token entropy is about 3 nats (kept-set median 40-50
tokens at top_p 0.9, like SmolLM2 on the main job); near-uniform distributions are the slow case of top-p (see the
``--entropy-scale`` flag). Memory is the peak RSS above the process's RSS once the inputs exist (MiB).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_support.py [--shapes 16x80x32,16x80x512,4x80x4096] [--write]
        [--resume earlier_stdout.log]   # reuse the cells an interrupted run printed
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

BEGIN = "<!-- BEGIN bench_support.py output -->"
END = "<!-- END bench_support.py output -->"
V, H = 49152, 576


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _inputs(b, p, t, scale, requires_grad):
    import torch

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=g) * scale * 10 / H**0.5).requires_grad_(requires_grad)
    hidden = torch.randn(b, p + t, H, generator=g).requires_grad_(requires_grad)
    ids = torch.randint(0, V, (b, p + t), generator=g)
    return hidden, weight, ids, torch.ones_like(ids)


def measure(kind: str, b: int, p: int, t: int, sampler: dict, scale: float) -> dict:
    """One measurement in this process: {"cpu_s", "peak_mib", "size_p50"}."""
    import torch

    from trl_rollout_corr import support

    torch.set_num_threads(1)
    if b * p * t > 8:  # warm-up on a tiny input first (one-off compilation and allocator growth are not measured)
        measure(kind, 1, 2, 2, sampler, scale)
    grad = kind != "support_fwd"
    hidden, weight, ids, mask = _inputs(b, p, t, scale, grad)
    spec = support.sampler_from_vllm_params(sampler)
    base, size_p50 = _rss_mib(), None
    t0 = time.process_time()
    if kind == "trl_head":
        from trl.kernels import ChunkedLogProbFunction

        flat = hidden[:, :-1].reshape(-1, H)
        logp, entropy, *_ = ChunkedLogProbFunction.apply(flat, weight, None, ids[:, 1:].reshape(-1), 1.0, 32768,
                                                          None, 1.0, ("log_probs", "entropy"))
        logp.sum().backward()
    elif kind == "dense":
        logits = hidden[:, p - 1:-1] @ weight.t()
        threshold = support.recompute_threshold(logits.detach().reshape(-1, V), spec).view(b, t, 1)
        logp = torch.log_softmax(logits.masked_fill(logits < threshold, float("-inf")), -1)
        logp.gather(-1, ids[:, p:].unsqueeze(-1)).sum().backward()
    else:
        with torch.set_grad_enabled(grad):
            score = support.SupportScorer(spec, "recompute").score(hidden, weight, None, ids, mask, t)
        if grad:
            score.log_probs.sum().backward()
        size_p50 = float(score.size.float().median())
    cpu = time.process_time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"cpu_s": cpu, "peak_mib": max(peak - base, 0.0), "size_p50": size_p50}


def earlier_rows(log_path: str) -> dict:
    """The cells an earlier run printed (its stdout, one dict per line), keyed by (shape, kind)."""
    rows = {}
    for line in Path(log_path).read_text().splitlines():
        if line.startswith("{'shape'"):
            row = ast.literal_eval(line)
            rows[(tuple(row["shape"]), row["kind"])] = {**row, "earlier": True}
    return rows


def run_all(shapes, sampler, scale, dense_limit_gib, earlier=None) -> list[dict]:
    rows = []
    for b, p, t in shapes:
        for kind in ("trl_head", "support_fwd", "support_fwd_bwd", "dense"):
            if earlier and ((b, p, t), kind) in earlier:
                rows.append(earlier[((b, p, t), kind)])
                print(rows[-1], flush=True)
                continue
            dense_gib = 3 * b * t * V * 4 / 2**30  # logits, masked logits, log-softmax (+ their gradients)
            if kind == "dense" and dense_gib > dense_limit_gib:
                rows.append({"shape": (b, p, t), "kind": kind, "skipped": f"needs > {dense_gib:.1f} GiB"})
                continue
            cmd = [sys.executable, __file__, "--one", json.dumps([kind, b, p, t, sampler, scale])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ,
                                                                                      "OMP_NUM_THREADS": "1"})
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"shape": (b, p, t), "kind": kind, **result})
            print(rows[-1], flush=True)
    return rows


def report(rows, sampler, load) -> str:
    lines = [BEGIN, "", "### Support matching: memory and time at a 49k vocabulary (`benchmarks/bench_support.py`)",
             "",
             f"SmolLM2-135M's head shape (V = {V}, H = {H}), float32, one thread, sampler {sampler} (vLLM order); "
             "random inputs scaled to ~3 nats of next-token entropy. *peak* = peak RSS above the inputs (MiB), in a "
             "fresh process per cell after a warm-up call on a tiny input; *cpu* = process CPU seconds (forward + "
             "backward unless noted). "
             f"Load average {load[0]:.1f} / {load[1]:.1f} before / after (shared 2-core machine)."
             + (" Cells marked * were measured by an earlier run of this script (same code, `--resume`)."
                if any(r.get("earlier") for r in rows) else ""), "",
             "| B x P x T | positions scored (TRL / ours) | TRL fused head fwd+bwd: cpu, peak | ours pi_old "
             "(fwd, no grad): cpu, peak | ours pi_theta (fwd+bwd): cpu, peak | dense (B, T, V) fwd+bwd: cpu, peak "
             "| kept-set p50 |",
             "|---|---|---|---|---|---|---|"]
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(tuple(r["shape"]), {})[r["kind"]] = r
    for (b, p, t), cells in by_shape.items():
        def cell(kind):
            r = cells.get(kind)
            if r is None:
                return "n/a"
            if "skipped" in r:
                return f"not run ({r['skipped']})"
            return f"{r['cpu_s']:.1f} s, {r['peak_mib']:.0f} MiB{' *' if r.get('earlier') else ''}"
        p50 = cells.get("support_fwd", {}).get("size_p50")
        lines.append(f"| {b} x {p} x {t} | {b * (p + t - 1)} / {b * t} | {cell('trl_head')} | {cell('support_fwd')} "
                     f"| {cell('support_fwd_bwd')} | {cell('dense')} | {p50 if p50 is not None else 'n/a'} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x80x32,16x80x512,4x80x4096", help="comma list of BxPxT")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--entropy-scale", type=float, default=0.5, help="logit scale (0.5: ~3 nats; 0.05: ~uniform)")
    ap.add_argument("--dense-limit-gib", type=float, default=4.0)
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    ap.add_argument("--resume", help="stdout of an earlier run: its cells are reused, only the others measured")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, b, p, t, sampler, scale = json.loads(args.one)
        print(json.dumps(measure(kind, b, p, t, sampler, scale)))
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    sampler = {"top_p": args.top_p}
    load_before = os.getloadavg()[0]
    earlier = earlier_rows(args.resume) if args.resume else None
    rows = run_all(shapes, sampler, args.entropy_scale, args.dense_limit_gib, earlier)
    text = report(rows, sampler, (load_before, os.getloadavg()[0]))
    print(text)
    if args.write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
