"""Asynchronous GRPO's step time on the main job (issue 45): synchronous at 1 and 2 torch threads vs asynchronous at
d = 1 and 2 (server 1 thread + trainer 1 thread) and d = 1 with the trainer at 2 threads (``async_d1_t2``), split into
generate / train / wait / publish. The server's "1 thread" is its OpenMP threads: vLLM CPU's engine core busy-waits
on its shared-memory queue while the worker generates, so it occupies up to 2 cores then (``async_cells``).

Every run is a fresh process (``--worker``) training SmolLM2-135M-Instruct (float32) on the main job's task
(reasoning-gym chain_sum, the CPU config's batch: 16 completions per step, 32 tokens, ``decoupled_k3_rs_token_tis``)
for ``--steps`` optimizer steps. ``--engine server`` (default): every setting generates with TRL's vLLM server
(``trl-rollout-corr vllm-serve``, float32, started per run with the setting's thread count, gloo weight sync):

* ``sync_t1`` / ``sync_t2``: TRL's own server path (sync, then generate, every step; ``rollout_async_depth=0``),
  trainer and server at 1 / 2 threads. generate = the time inside ``_generate_single_turn`` (the weight sync
  included); train = step - generate.
* ``async_d1`` / ``async_d2`` / ``async_d1_t2``: ``rollout_async_depth=d``, trainer at 1 (``_t2``: 2) threads,
  server at 1 thread.
  generate = the engine's ``rollout_async/generate_s``; wait = ``trainer_wait_s``; publish = ``publish_s`` (the CPU
  copy; the push to the server runs on the worker thread); train = step - wait - publish. Overlap efficiency =
  max(generate, train) / step (1.0: perfect overlap; the goal is >= 0.9).

``--engine transformers``: the synchronous runs use transformers' batched ``generate`` in the trainer and the
asynchronous ones the transformers engine process (one row at a time): not the same generator.

Step times are wall clock per optimizer step (a callback's ``on_step_begin`` -> ``on_step_end``); step 1 (warm-up,
and nothing to overlap with yet) is left out of the medians. The settings run interleaved (``async_cells.SETTINGS``
order, reversed every other round). Needs both cores and nothing else running (the vLLM
venv, with this package installed there):

    .venv-vllm/bin/python benchmarks/bench_async.py [--engine server] [--model models/SmolLM2-135M-Instruct]
        [--steps 6] [--rounds 2] [--out outputs/bench_async]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import async_cells as cells  # noqa: E402  (benchmarks/, next to this file: the settings, server, config, clock)
from async_cells import SETTINGS  # noqa: E402  ({setting: (depth, trainer, server threads)})


def worker(setting: str, model: str, steps: int, out: Path, engine: str) -> None:
    """One run in this process; writes ``out/<setting>.json`` with the per-step split (``async_cells.step_rows``)."""
    threads = cells.set_threads(setting)
    train_task, _ = cells.main_job_tasks(2000, 1)
    with cells.serve(setting, model, engine, out / f"{setting}_server.log") as server:
        import grpo_recipe_utils as ru  # recipes/, on the path after main_job_tasks

        args = cells.grpo_config(setting, out, server, steps=steps, batch=16, lr=3e-5, preset=cells.DEFAULT_PRESET,
                                 seed=42)
        clock = cells.TrainingClock()
        cls, stamp = cells.clocked_trainer(clock)
        trainer = cls(model=model, reward_funcs=[ru.split_reward_func({"train": train_task})], args=args,
                      train_dataset=ru.split_dataset(train_task, "train"))
        trainer.add_callback(stamp)
        try:
            trainer.train()
        finally:
            cells.close(trainer, server)
    depth = SETTINGS[setting][0]
    rows = cells.step_rows(depth, clock.step_s, [h for h in trainer.state.log_history if "loss" in h],
                           trainer.generate_s)
    (out / f"{setting}.json").write_text(json.dumps({"setting": setting, "depth": depth, "threads": threads,
                                                     "steps": rows}, indent=1))


def summarise(runs: dict[str, list[dict]]) -> str:
    """The Markdown table: per setting, medians over rounds of the per-run medians (steps 2..n).

    Two overlap efficiencies for the asynchronous settings: ``own`` = max(G, T) / step with G and T of the
    asynchronous run itself (T = step - wait - publish, so it is near 1 whenever the trainer never waits: it shows
    only that generation is hidden), and ``vs sync_t1`` = max(G, T) of the 1-thread synchronous run / the
    asynchronous step (below 1 when running the engine beside the trainer slows the trainer down)."""
    med = {}
    for setting, results in runs.items():
        med[setting] = {k: statistics.median(statistics.median(r[k] for r in res["steps"][1:]) for res in results)
                        for k in ("step_s", "generate_s", "train_s", "wait_s", "publish_s")}
    base = med.get("sync_t1")
    lines = ["| setting | step s | generate s | train s | wait s | publish s | overlap eff. (own) | "
             "overlap eff. (vs sync_t1) |", "|---|---|---|---|---|---|---|---|"]
    for setting, m in med.items():
        asynchronous = SETTINGS[setting][0] > 0
        own = f"{max(m['generate_s'], m['train_s']) / m['step_s']:.2f}" if asynchronous else "-"
        ref = (f"{max(base['generate_s'], base['train_s']) / m['step_s']:.2f}" if asynchronous and base else "-")
        lines.append(f"| {setting} | {m['step_s']:.2f} | {m['generate_s']:.2f} | {m['train_s']:.2f} | "
                     f"{m['wait_s']:.2f} | {m['publish_s']:.3f} | {own} | {ref} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_async"))
    parser.add_argument("--worker", choices=list(SETTINGS))
    parser.add_argument("--engine", choices=["server", "transformers"], default="server",
                        help="server: TRL's vLLM server (float32) for every setting (sync: TRL's server path); "
                        "transformers: TRL's generate in the trainer (sync) vs the transformers engine process")
    parser.add_argument("--summarise", metavar="DIR", help="only rebuild the table from DIR/round*/<setting>.json")
    a = parser.parse_args()
    out = Path(a.out)
    if a.summarise:
        found = {s: [json.loads(p.read_text()) for p in sorted(Path(a.summarise).glob(f"round*/{s}.json"))]
                 for s in SETTINGS}
        print(summarise({s: res for s, res in found.items() if res}))
        return
    if a.worker:
        worker(a.worker, a.model, a.steps, out, a.engine)
        return
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(a.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for setting in order:
            rout = out / f"round{r}"
            rout.mkdir(parents=True, exist_ok=True)
            started = time.time()
            subprocess.run([sys.executable, __file__, "--worker", setting, "--model", a.model, "--steps",
                            str(a.steps), "--out", str(rout), "--engine", a.engine], check=True)
            runs[setting].append(json.loads((rout / f"{setting}.json").read_text()))
            print(f"round {r} {setting}: {time.time() - started:.0f} s", flush=True)
    table = summarise(runs)
    (out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
