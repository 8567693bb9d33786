"""Cost of rollout records (`rollout_dump_dir`): writer time per step and bytes per 1k samples.

Two measurements, for the issue-13 section of benchmarks/RESULTS.md:

1. Synthetic micro-batches through `records.RolloutRecordWriter` (the trainer's exact path: `add` per micro-batch,
   `end_window` per logged step), decoupled columns (mu, pi_old, pi_theta, IS weights, RS mask), at three sizes:
   the CPU main job (16 rows, 64 prompt + 32 completion tokens), a medium GPU step (256 rows, 256 + 1024 tokens, 4
   micro-batches) and a large one (1024 rows, 512 + 4096 tokens, 16 micro-batches). Random ids and log-probs do
   not compress: an upper bound on size. Wall and process-CPU seconds per step, median of REPEATS, 1 torch thread.
2. The worst case for the ratio: the tiny random model of the tests (steps of a tenth of a second), the same
   8-step run with and without `rollout_dump_dir`, interleaved, process CPU time per step.
3. A real dump (optional argument): the writer's own cumulative cost recorded in `logs.jsonl` (`writer.seconds`,
   `writer.cpu_seconds`) against TRL's `step_time` of the same steps, and the dump's bytes per 1k samples.

    python benchmarks/rollout_records_cost.py [DUMP_DIR]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trl_rollout_corr.records import MicroBatch, RolloutRecordWriter, open_dump

SIZES = {  # name: (rows per step, prompt tokens, completion tokens, micro-batches per step)
    "main job (CPU)": (16, 64, 32, 1),
    "medium GPU step": (256, 256, 1024, 4),
    "large GPU step": (1024, 512, 4096, 16),
}
REPEATS = 5


def micro_batch(rows: int, prompt: int, completion: int, step: int, generator: torch.Generator) -> MicroBatch:
    lengths = torch.randint(completion // 4, completion + 1, (rows,), generator=generator)
    mask = (torch.arange(completion).expand(rows, completion) < lengths.unsqueeze(1)).long()
    mu = -torch.rand(rows, completion, generator=generator) * 3
    return MicroBatch(
        step=step, generation_step=step, generation_batch=step,
        prompt_ids=torch.randint(2, 49000, (rows, prompt), generator=generator),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        completion_ids=torch.where(mask > 0, torch.randint(2, 49000, (rows, completion), generator=generator), 0),
        completion_mask=mask, rollout_log_probs=mu, advantages=torch.randn(rows, generator=generator),
        generation_row=torch.arange(rows), rewards=torch.rand(rows, 1, generator=generator),
        times=torch.zeros(rows, 2, dtype=torch.float64),
        per_token=dict(old_log_probs=mu + 0.01, log_probs=mu + 0.02, rollout_is_weights=torch.ones(rows, completion),
                       rollout_rs_mask=mask),
    )


def synthetic() -> None:
    print("| step size | rows/step | tokens/step (prompt + completion) | writer wall s/step | writer CPU s/step | "
          "s per 1k samples | MB on disk per 1k samples |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (rows, prompt, completion, micro) in SIZES.items():
        per_micro = rows // micro
        batches = [micro_batch(per_micro, prompt, completion, 0, g) for _ in range(micro)]
        walls, cpus, sizes = [], [], []
        for r in range(REPEATS):
            folder = Path(tempfile.mkdtemp(prefix="records_cost_"))
            writer = RolloutRecordWriter(folder / "dump", eos_token_ids=[1], pad_token_id=0,
                                         max_completion_length=completion)
            writer.write_run_metadata({"schema": "trl-rollout-corr/rollout-records", "schema_version": "1.0"})
            w0, c0 = time.perf_counter(), time.process_time()
            for b in batches:
                writer.add(b)
            writer.end_window(1, {"rollout_corr/kl": 0.0})
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
            sizes.append(writer.bytes_written)
            shutil.rmtree(folder)
        tokens = rows * (prompt + sum(int(b.completion_mask.sum()) for b in batches) / rows)
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(f"| {name} | {rows} | {tokens:,.0f} | {wall:.3f} | {cpu:.3f} | {1000 * wall / rows:.2f} | "
              f"{sizes[0] / rows * 1000 / 1e6:.1f} |")


def real(dump_dir: str) -> None:
    dump = open_dump(dump_dir)
    steps = [w for w in dump.windows if w.writer]
    previous = {"seconds": 0.0, "cpu_seconds": 0.0}
    print(f"\nReal dump {dump_dir}: {dump.metadata.get('model', {}).get('name_or_path')}, "
          f"engine {dump.metadata.get('engine', {}).get('rollout_engine')}")
    print("| logged step | TRL step_time s | writer wall s | writer CPU s | writer / step |")
    print("|---|---|---|---|---|")
    shares = []
    for w in steps:
        wall = w.writer["seconds"] - previous["seconds"]
        cpu = w.writer["cpu_seconds"] - previous["cpu_seconds"]
        step_time = w.metrics.get("step_time", float("nan"))
        shares.append(wall / step_time)
        print(f"| {w.logged_step} | {step_time:.1f} | {wall:.3f} | {cpu:.3f} | {100 * wall / step_time:.3f}% |")
        previous = w.writer
    total_bytes = sum(p.stat().st_size for w in dump.windows for p in w.files)
    rows = dump.read_table().num_rows
    run_bytes = (Path(dump_dir) / "run.json").stat().st_size + (Path(dump_dir) / "logs.jsonl").stat().st_size
    print(f"\n{rows} rows in {total_bytes:,} bytes of Parquet ({total_bytes / rows * 1000 / 1e6:.2f} MB per 1k "
          f"samples; run.json + logs.jsonl {run_bytes:,} bytes); writer share of the step: max "
          f"{100 * max(shares):.3f}%")


def tiny_trainer_ab(rounds: int = 4, steps: int = 8) -> None:
    """Worst case: the tiny random Llama of the tests (steps of ~0.1 s CPU), the same run with and without
    rollout_dump_dir, interleaved, process CPU seconds per optimizer step (median over rounds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    work = Path(tempfile.mkdtemp(prefix="records_ab_"))
    model_dir = make_tiny_model_dir(str(work / "model"), "llama", seed=0)
    per_step = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            dump = str(work / f"dump{r}") if mode == "on" else None
            args = RolloutCorrGRPOConfig(
                output_dir=str(work / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=8, max_steps=steps, logging_steps=1, report_to=[], use_cpu=True,
                learning_rate=1e-3, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, bf16=False,
                rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_dump_dir=dump)
            trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                             train_dataset=prompt_dataset(8))
            c0 = time.process_time()
            trainer.train()
            per_step[mode].append((time.process_time() - c0) / steps)
    shutil.rmtree(work)
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
    print(f"\nTiny model (worst case), CPU s per step, median of {rounds}: without records {off:.4f}, with records "
          f"{on:.4f} ({100 * (on - off) / off:+.1f}%); all rounds: off {per_step['off']}, on {per_step['on']}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    synthetic()
    tiny_trainer_ab()
    if len(sys.argv) > 1:
        real(sys.argv[1])
