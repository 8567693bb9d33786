"""TRL's server path on CPU (``trl-rollout-corr vllm-serve`` + the gloo weight sync) measured against the main job.

Two parts, each printing one JSON line per measurement (and appending it to ``--out``):

* ``rescore``: for each engine dtype (float32, bfloat16) start the server (start-up seconds), sync the trainer's
  float32 weights ``--syncs`` times (seconds each), sample the main job's first 16 training prompts (temperature 1,
  32 tokens, as ``recipes/configs/cpu_smollm2_decoupled.yaml``) and re-score every sampled token with the trainer in
  float32: max and mean |log mu - log pi| over the tokens.
* ``steps``: the main job (``recipes/grpo_rollout_corr.py`` with the CPU config) for ``--steps`` steps, 1 torch
  thread, ``--eval_size 0``, interleaving the ``rollout_func`` engine (vllm_cpu, bf16, in process), TRL's colocate
  engine (bf16, eager) and the server path (bf16 server started by the recipe, ``--vllm_server_start``) ``--rounds``
  times (the order reversed every other round): per step, generate / sync / train seconds (train = step - generate
  - sync), means over steps 2..N, and the engine's start-up seconds.

    python benchmarks/trl_vllm_server_bench.py rescore --out outputs/server_bench.jsonl
    python benchmarks/trl_vllm_server_bench.py steps --rounds 2 --out outputs/server_bench.jsonl
    python benchmarks/trl_vllm_server_bench.py table outputs/server_bench.jsonl   # the RESULTS.md table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", str(ROOT / "models" / "SmolLM2-135M-Instruct"))
CONFIG = ROOT / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def emit(out: Path, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out, "a") as f:
        f.write(line + "\n")


def rescore(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.generation.vllm_client import VLLMClient

    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_recipe_utils as ru
    from trl_rollout_corr import trl_compat
    from trl_rollout_corr.engines.vllm_serve import VLLMServer, free_port

    torch.set_num_threads(1)
    trl_compat.install_vllm_client_cpu_weight_sync()
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(MODEL)
    task, _ = ru.make_task_splits("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                                  16, 42, 1, 1_000_000, ru.DEFAULT_INSTRUCTION)
    prompts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
               for p in ru.split_dataset(task, "train")["prompt"]]
    meta = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
    for dtype in args.dtypes:
        srv = VLLMServer(MODEL, dtype, log_path=str(Path(args.out).parent / f"server_{dtype}.log"),
                         extra_args=["--max_model_len", "512"], env=SERVER_ENV, timeout_s=600)
        with srv:
            client = VLLMClient(base_url=srv.base_url, group_port=free_port(), connection_timeout=30)
            client.init_communicator(device=torch.device("cpu"))
            syncs = []
            for _ in range(args.syncs):
                t0 = time.perf_counter()
                client.update_named_params(meta, ((n, p.data) for n, p in model.named_parameters()))
                syncs.append(time.perf_counter() - t0)
            client.reset_prefix_cache()
            t0 = time.perf_counter()
            out = client.generate(prompts, n=1, max_tokens=32, temperature=1.0, logprobs=0,
                                  generation_kwargs={"seed": 0})
            gen_s = time.perf_counter() - t0
            gaps = []
            for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
                ids = torch.tensor([p + c])
                with torch.no_grad():
                    logits = model(ids).logits[0, len(p) - 1 : -1].float()
                pi = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p):, None])[:, 0]
                gaps.append((torch.tensor([s[0] for s in lp]) - pi).abs())
            gap = torch.cat(gaps)
            client.close_communicator()
        emit(Path(args.out), {"part": "rescore", "engine_dtype": dtype, "startup_s": round(srv.startup_s, 1),
                              "sync_s": [round(s, 2) for s in syncs], "generate_16x32_s": round(gen_s, 2),
                              "tokens": gap.numel(), "max_abs_gap": gap.max().item(),
                              "mean_abs_gap": gap.mean().item()})


def steps(args) -> None:
    import subprocess

    for r in range(args.rounds):
        for path in (args.paths if r % 2 == 0 else args.paths[::-1]):
            out = Path(args.out).parent / f"steps_{path}_r{r}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "one-run", "--path", path, "--output_dir", str(out),
                   "--steps", str(args.steps), "--out", args.out, "--round", str(r)]
            subprocess.run(cmd, check=True, cwd=ROOT)


def one_run(args) -> None:
    """One recipe run, timed per step (generate / sync from wrappers, step from the step callbacks)."""
    import importlib.util

    import torch
    from transformers import TrainerCallback
    from trl import ModelConfig, TrlParser

    sys.path.insert(0, str(ROOT / "recipes"))

    spec = importlib.util.spec_from_file_location("grpo_rollout_corr_bench", ROOT / "recipes" / "grpo_rollout_corr.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses resolve the module by name
    spec.loader.exec_module(recipe)
    flags = ["--config", str(CONFIG), "--model_name_or_path", MODEL, "--output_dir", args.output_dir,
             "--max_steps", str(args.steps), "--eval_size", "0", "--torch_threads", "1", "--report_to", "none",
             "--plots", "false"]
    if args.path in ("server", "colocate"):
        flags += ["--rollout_engine", "trl_vllm", "--use_vllm", "true", "--vllm_mode", args.path]
    if args.path == "server":
        flags += ["--vllm_server_start", "true"]
    parser = TrlParser((recipe.ScriptArguments, recipe.RolloutCorrGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=flags)
    timings: dict = {"generate": {}, "sync": {}, "step": {}}

    class Timed(recipe.RolloutCorrGRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            rollout = kw.get("rollout_func")  # the rollout_func engine: per-step deltas of its own counters
            if getattr(self, "vllm_generation", None) is not None:
                self._wrap(self.vllm_generation, "generate", "generate")
                self._wrap(self.vllm_generation, "sync_weights", "sync")
            trainer = self

            class StepClock(TrainerCallback):
                def on_step_begin(self, *_a, **_k):
                    trainer._t_step = time.perf_counter()

                def on_step_end(self, _args, state, *_a, **_k):
                    timings["step"][state.global_step] = time.perf_counter() - trainer._t_step
                    if rollout is not None:
                        seen = trainer.__dict__.setdefault("_seen", [0.0, 0.0])
                        gen, sync = rollout.generate_seconds, rollout.sync_seconds
                        timings["generate"][state.global_step] = gen - seen[0]
                        timings["sync"][state.global_step] = sync - seen[1]
                        seen[:] = [gen, sync]

            self.add_callback(StepClock())

        def _wrap(self, obj, name, kind):
            fn = getattr(obj, name)
            trainer = self

            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    step = trainer.state.global_step + 1
                    timings[kind][step] = timings[kind].get(step, 0.0) + time.perf_counter() - t0

            setattr(obj, name, timed)

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    results = recipe.main(script_args, training_args, model_args, trainer_cls=Timed)
    wall_s = time.perf_counter() - t_start
    later = [s for s in timings["step"] if s >= 2]

    def mean(kind):
        vals = [timings[kind].get(s, 0.0) for s in later]
        return round(sum(vals) / len(vals), 2) if vals else None

    record = {"part": "steps", "path": args.path, "round": args.round, "wall_s": round(wall_s, 1),
              "steps": len(timings["step"]), "step_s": mean("step"),
              "generate_s": mean("generate"), "sync_s": mean("sync"),
              "engine": results["engine"], "per_step": timings}
    if record["step_s"] is not None and record["generate_s"] is not None:
        record["train_s"] = round(record["step_s"] - record["generate_s"] - (record["sync_s"] or 0.0), 2)
    emit(Path(args.out), record)


def table(path: Path) -> str:
    """The RESULTS.md table of the ``steps`` records in ``path``: per path, the median over rounds of each round's
    means over steps 2..N (seconds), the rounds' range of the step time, and the step-time ratio to ``rollout_func``
    computed within each round (interleaved runs) then its median."""
    import statistics

    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("part") == "steps"]
    by_round: dict = {}
    for r in recs:
        by_round.setdefault(r.get("round", 0), {})[r["path"]] = r
    rows = ["| path | rounds | step (median, range) | generate | sync | train | step / rollout_func |",
            "|---|---|---|---|---|---|---|"]
    for path in ("rollout_func", "colocate", "server"):
        mine = [rs[path] for rs in by_round.values() if path in rs]
        if not mine:
            continue
        ratios = [rs[path]["step_s"] / rs["rollout_func"]["step_s"] for rs in by_round.values()
                  if path in rs and "rollout_func" in rs]

        def med(key):
            vals = [m[key] for m in mine if m.get(key) is not None]
            return f"{statistics.median(vals):.2f} s" if vals else "-"

        steps = [m["step_s"] for m in mine]
        rows.append(f"| {path} | {len(mine)} | {statistics.median(steps):.2f} s ({min(steps):.2f}-{max(steps):.2f}) "
                    f"| {med('generate_s')} | {med('sync_s')} | {med('train_s')} "
                    f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("rescore")
    r.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    r.add_argument("--syncs", type=int, default=3)
    s = sub.add_parser("steps")
    s.add_argument("--rounds", type=int, default=1)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--paths", nargs="+", default=["rollout_func", "colocate", "server"])
    o = sub.add_parser("one-run")
    o.add_argument("--path", choices=["rollout_func", "colocate", "server"], required=True)
    o.add_argument("--round", type=int, default=0)
    t = sub.add_parser("table")
    t.add_argument("jsonl")
    o.add_argument("--output_dir", required=True)
    o.add_argument("--steps", type=int, default=4)
    for q in (r, s, o):
        q.add_argument("--out", default="outputs/server_bench/results.jsonl")
    args = p.parse_args()
    if args.part == "table":
        print(table(Path(args.jsonl)))
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    {"rescore": rescore, "steps": steps, "one-run": one_run}[args.part](args)


if __name__ == "__main__":
    main()
