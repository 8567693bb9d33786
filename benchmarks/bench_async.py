"""Asynchronous GRPO's step time on the main job (issue 45): synchronous at 1 and 2 torch threads vs asynchronous at
d = 1 and 2 (engine 1 thread + trainer 1 thread), split into generate / train / wait / publish.

Every run is a fresh process (``--worker``) training SmolLM2-135M-Instruct (float32) on the main job's task
(reasoning-gym chain_sum, the CPU config's batch: 16 completions per step, 32 tokens, ``decoupled_k3_rs_token_tis``)
for ``--steps`` optimizer steps. ``--engine server`` (default): every setting generates with TRL's vLLM server
(``trl-rollout-corr vllm-serve``, float32, started per run with the setting's thread count, gloo weight sync):

* ``sync_t1`` / ``sync_t2``: TRL's own server path (sync, then generate, every step; ``rollout_async_depth=0``),
  trainer and server at 1 / 2 threads. generate = the time inside ``_generate_single_turn`` (the weight sync
  included); train = step - generate.
* ``async_d1`` / ``async_d2``: ``rollout_async_depth=d``, trainer at 1 thread, server at 1 thread.
  generate = the engine's ``rollout_async/generate_s``; wait = ``trainer_wait_s``; publish = ``publish_s`` (the CPU
  copy; the push to the server runs on the worker thread); train = step - wait - publish. Overlap efficiency =
  max(generate, train) / step (1.0: perfect overlap; the goal is >= 0.9).

``--engine transformers``: the synchronous runs use transformers' batched ``generate`` in the trainer and the
asynchronous ones the transformers engine process (one row at a time): not the same generator.

Step times are wall clock per optimizer step (a callback's ``on_step_begin`` -> ``on_step_end``); step 1 (warm-up,
and nothing to overlap with yet) is left out of the medians. The settings run interleaved (``sync_t1, sync_t2,
async_d1, async_d2``, the order reversed every other round). Needs both cores and nothing else running (the vLLM
venv, with this package installed there):

    .venv-vllm/bin/python benchmarks/bench_async.py [--engine server] [--model models/SmolLM2-135M-Instruct]
        [--steps 6] [--rounds 2] [--out outputs/bench_async]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"sync_t1": (0, 1), "sync_t2": (0, 2), "async_d1": (1, 1), "async_d2": (2, 1)}  # (depth, trainer threads)


def worker(setting: str, model: str, steps: int, out: Path, engine: str) -> None:
    """One run in this process; writes ``out/<setting>.json`` with the per-step split."""
    if engine == "server":  # TRL's vLLM server (float32, threads as the trainer's), started for this run
        from trl_rollout_corr.engines.vllm_serve import VLLMServer

        threads = str(SETTINGS[setting][1])
        with VLLMServer(model, "float32", log_path=str(out / f"{setting}_server.log"), timeout_s=600,
                        extra_args=["--max_model_len", "1024"],
                        env={"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as server:
            return _train(setting, model, steps, out, server)
    return _train(setting, model, steps, out, None)


def _train(setting: str, model: str, steps: int, out: Path, server) -> None:
    depth, threads = SETTINGS[setting]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT / "recipes"))
    from transformers import TrainerCallback

    import grpo_recipe_utils as ru
    from trl_rollout_corr.engines.vllm_serve import free_port
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    train_task, _ = ru.make_task_splits("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                      "max_digits": 2}, 2000, 42, 1, 1_000_000,
                                        ru.DEFAULT_INSTRUCTION)

    class Timed(RolloutCorrGRPOTrainer):
        generate_s: list = []

        def _generate_single_turn(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generate_s.append((self.state.global_step, time.perf_counter() - started))

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.started)

    args = RolloutCorrGRPOConfig(
        output_dir=str(out / setting), per_device_train_batch_size=16, num_generations=4, max_completion_length=32,
        max_steps=steps, learning_rate=3e-5, lr_scheduler_type="constant", temperature=1.0, beta=0.0,
        loss_type="dapo", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=42,
        disable_tqdm=True, rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_async_depth=depth,
        rollout_async_engine_threads=1, model_init_kwargs={"dtype": torch.float32},
        **({} if server is None else dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url,
                                          vllm_group_port=free_port(), vllm_server_timeout=60,
                                          rollout_async_server_log=str(server.log_path))))
    trainer = Timed(model=model, reward_funcs=[ru.split_reward_func({"train": train_task})], args=args,
                    train_dataset=ru.split_dataset(train_task, "train"))
    clock = Clock()
    trainer.add_callback(clock)
    try:
        trainer.train()
    finally:
        if server is not None:
            trainer.vllm_generation.vllm_client.close_communicator()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rows = []
    for i, (step_s, h) in enumerate(zip(clock.steps, logs)):
        if depth:
            gen, wait, pub = (h.get(f"rollout_async/{k}", 0.0) for k in ("generate_s", "trainer_wait_s",
                                                                            "publish_s"))
            rows.append(dict(step=i + 1, step_s=step_s, generate_s=gen, wait_s=wait, publish_s=pub,
                             train_s=step_s - wait - pub))
        else:
            gen = sum(s for g, s in trainer.generate_s if g == i)
            rows.append(dict(step=i + 1, step_s=step_s, generate_s=gen, wait_s=0.0, publish_s=0.0,
                             train_s=step_s - gen))
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
