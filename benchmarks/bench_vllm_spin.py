"""The vLLM CPU server's busy-wait (``engines/vllm_spin.py``): cores it keeps busy and seconds it takes to generate,
with vLLM's default reader spin (1 s) and with none (``TRL_ROLLOUT_CORR_VLLM_SPIN_S=0``, the CPU default of
``trl-rollout-corr vllm-serve`` since 2026-12-07).

Per server (``VLLMServer``, float32 SmolLM2-135M, ``--threads`` OpenMP threads, started per run): one warm-up call,
then ``--calls`` calls of TRL's ``VLLMClient.generate`` (``--prompts`` prompts x 4 completions, ``--max-tokens``
tokens, temperature 1). Measured over those calls: wall seconds and the CPU seconds of the server's process group
(``cpu_accounting``: its API server, engine core and worker), i.e. the cores it kept busy; then ``--idle-s`` seconds
with no request (the spin should end there either way). Servers alternate A B B A ... (``--rounds`` pairs) so drift
hits both; the report gives per setting the mean and, per pair, the ratio (spin 0 / spin 1) with its 95 % t-interval
on the log ratio (n - 1 df). Needs a quiet machine (the foreign load is printed); one run is about 2 minutes a server.

    PYTHONPATH=$PWD TRL_ROLLOUT_CORR_SMOLLM2=models/SmolLM2-135M-Instruct \\
        .venv-vllm/bin/python benchmarks/bench_vllm_spin.py --rounds 2 --json outputs/bench_vllm_spin.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cpu_accounting  # noqa: E402

SETTINGS = {"spin1": "1", "spin0": "0"}  # label -> TRL_ROLLOUT_CORR_VLLM_SPIN_S


def order(rounds: int) -> list[str]:
    """``spin1 spin0 spin0 spin1 ...``: pairs alternate their order (``rounds`` pairs)."""
    out = []
    for r in range(rounds):
        pair = ["spin1", "spin0"] if r % 2 == 0 else ["spin0", "spin1"]
        out += pair
    return out


def log_ratio_interval(pairs: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """Mean ratio b / a over (a, b) pairs as exp(mean log ratio) with the 95 % t-interval (n - 1 df); None under 2."""
    if len(pairs) < 2:
        return None
    from scipy import stats

    logs = [math.log(b / a) for a, b in pairs]
    m, s = statistics.fmean(logs), statistics.stdev(logs)
    h = stats.t.ppf(0.975, len(logs) - 1) * s / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def run_server(label: str, args: argparse.Namespace) -> dict:
    """One server with ``label``'s spin: its generate seconds and cores, and its cores while idle."""
    import torch
    from trl.generation.vllm_client import VLLMClient

    from trl_rollout_corr.engines.vllm_serve import VLLMServer

    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TRL_ROLLOUT_CORR_VLLM_SPIN_S": SETTINGS[label]}
    log = Path(args.out) / f"server_{label}_{int(time.time())}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    prompts = [f"Add {i} and {2 * i + 1}. Answer:" for i in range(args.prompts)]
    with VLLMServer(args.model, "float32", log_path=str(log), extra_args=["--max_model_len", "1024"], env=env,
                    timeout_s=600) as server:
        client = VLLMClient(base_url=server.base_url, connection_timeout=60)
        torch.manual_seed(0)
        client.generate(prompts, n=4, max_tokens=args.max_tokens, temperature=1.0)  # warm-up
        groups = {"server": os.getpgid(server.process.pid)}
        start = cpu_accounting.snapshot(groups)
        for _ in range(args.calls):
            client.generate(prompts, n=4, max_tokens=args.max_tokens, temperature=1.0)
        mid = cpu_accounting.snapshot(groups)
        time.sleep(args.idle_s)
        end = cpu_accounting.snapshot(groups)
    gen, idle = cpu_accounting.cpu_usage(start, mid), cpu_accounting.cpu_usage(mid, end)
    lines = [ln for ln in log.read_text().splitlines() if "vLLM queue readers busy-wait" in ln]
    return {"label": label, "generate_s": gen["wall_s"],
            "server_cores": round(gen["cpu_s"]["server"] / gen["wall_s"], 3),
            "idle_cores": round(idle["cpu_s"]["server"] / idle["wall_s"], 3), "foreign_cores": gen["foreign_cores"],
            "spin_lines": len(lines)}


def report(rows: list[dict]) -> str:
    """The table (mean per setting) and the paired ratios spin0 / spin1 of generate seconds and server cores."""
    out = ["| setting | runs | generate s (mean) | server cores generating | server cores idle | foreign cores |",
           "|---|---|---|---|---|---|"]
    for label in SETTINGS:
        mine = [r for r in rows if r["label"] == label]
        if mine:
            out.append(f"| {label} | {len(mine)} | {statistics.fmean(r['generate_s'] for r in mine):.2f} | "
                       f"{statistics.fmean(r['server_cores'] for r in mine):.2f} | "
                       f"{statistics.fmean(r['idle_cores'] for r in mine):.2f} | "
                       f"{max(r['foreign_cores'] for r in mine):.2f} |")
    pairs = list(zip(rows[0::2], rows[1::2]))
    for key in ("generate_s", "server_cores"):
        by = [(next(r for r in p if r["label"] == "spin1")[key], next(r for r in p if r["label"] == "spin0")[key])
              for p in pairs]
        ci = log_ratio_interval(by)
        if ci:
            out.append(f"\n{key}: spin0 / spin1 = {ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}] (95 % t-interval on the log "
                       f"ratio, n = {len(by)} pairs)")
        else:
            out.append(f"\n{key}: spin0 / spin1 per pair {[round(b / a, 3) for a, b in by]} (n < 2: no interval)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2",
                                                      str(ROOT / "models" / "SmolLM2-135M-Instruct")))
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_vllm_spin"))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for label in order(args.rounds):
        rows.append(run_server(label, args))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(report(rows))


if __name__ == "__main__":
    main()
