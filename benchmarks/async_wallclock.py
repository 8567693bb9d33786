"""Issue 47, "Build": held-out accuracy against training wall-clock seconds, synchronous against asynchronous GRPO.

The figure a user deciding whether to go asynchronous wants: does the real asynchronous pipeline reach a held-out
accuracy sooner in wall-clock time than synchronous on-policy GRPO on the same two cores?

Regime: the main job's task (reasoning-gym chain_sum, ``policy_lag_experiment``'s train split and held-out items)
from the BASE model SmolLM2-135M-Instruct (float32 trainer), ``--steps`` (32) optimizer steps of ``--prompts`` (8)
x 4 completions of at most 32 tokens, lr 3e-5 constant, DAPO loss, beta 0 (the asynchronous-lag grid's candidate
``base_32x8``, ``async_lag_grid.CANDIDATES``). Every setting generates with TRL's vLLM server (``--engine server``:
``trl-rollout-corr vllm-serve``, float32, started per cell with the setting's threads; ``bench_async.py``'s
settings, shared through ``async_cells``):

* ``sync_t1`` / ``sync_t2``: synchronous on-policy GRPO (``rollout_async_depth=0``: sync, then generate, every
  step), trainer and server at 1 / 2 torch threads;
* ``async_d1`` / ``async_d2``: the real asynchronous pipeline, ``rollout_async_depth=d`` on the server (the engine
  generates d steps ahead; trainer 1 thread, server 1 thread);
* ``async_d1_t2``: d = 1 with the trainer at 2 threads, server 1 thread.

Thread budget: a server's "threads" are its OpenMP threads, not its cores: vLLM CPU's engine-core process busy-waits
on vLLM's shared-memory message queue (``shm_broadcast``'s ``SpinCondition``) while the worker generates, so a
"1-thread" server occupies up to 2 cores while generating. The asynchronous settings oversubscribe the 2 cores
while the engine generates beside the trainer; each cell records the CPU seconds it used (see below).

Correction: every setting uses the same preset, the library's default decoupled one (``decoupled_k3_rs_token_tis``:
token TIS cap 2 + ``seq_mean_k3`` RS 0.01; ``--preset`` changes it for every setting). Each (setting, seed) is one
fresh process (a cell; training seed 41 + seed, as the lag grids), seeds 1..``--seeds``, run seed by seed with the
settings' order reversed on every even seed, so machine drift does not line up with a setting. Needs both cores and
nothing else running (the vLLM venv, with this package installed there).

What each number means:

* training seconds (the x axis): wall clock from ``train()``'s entry (before TRL builds its dataloader and the
  asynchronous engine starts) to each optimizer step's end, less the excluded time below. Everything the trainer
  does counts (generation, waits, weight syncs and publishes, logging, the asynchronous engine's start and its
  first batch); the server's launch and the model load before ``train()`` do not (the same for every setting;
  ``server_start_s`` is recorded). ``step_s``: each step's own seconds (``on_step_begin`` -> ``on_step_end``);
  the median step leaves step 1 out.
* evaluation: greedy, ``policy_lag_experiment.greedy_eval`` (the trainer's float32 policy, transformers ``generate``,
  32 new tokens) on the held-out items: the first ``--check-size`` (128) at step 0, every ``--check-dense-every`` (2)
  steps up to ``--check-dense-until`` (16), then every ``--check-every`` (8) steps (``check_steps``: 0, 2, ..., 16,
  24 at the defaults), ``--eval-size`` (512) after the last step (whose first 128 are the curve's last point). It
  runs AFTER training, on copies of the weights taken at those steps' ends, with the server stopped and at
  ``--eval-threads`` (2) for every cell. Why after: evaluating inside the run would let the asynchronous engine
  generate ahead for the whole evaluation (minutes) and then hand over batches that synchronous runs must wait for,
  and would share the cores with the engine. The copy (a ``state_dict`` clone, about a second or less) is taken at
  ``on_step_end`` after the step's stamp and after the trainer published the step's weights to the engine; its time
  is excluded from the clock for every setting (``excluded_s``). The asynchronous engine, a separate process, keeps
  generating during those copies (it cannot be paused without changing the pipeline): at most ``excluded_s``
  (recorded per cell) of free generation, against steps of tens of seconds.
* endpoints (``async_wallclock_report``): PRIMARY, the ratio of training seconds to reach the last step N, paired
  by seed against ``sync_t2`` (the 2-core user's real alternative) and against ``sync_t1``, a 95 % t-interval on the
  log ratio (n - 1 df) shown back-transformed. DESCRIPTIVE: accuracy (correct / n held-out items; the final
  512-item score, the accuracy at ``sync_t2``'s final training seconds, the 128-item curve, time-to-reach the
  start + ``--reach-points`` points), beside the A/A null ``sync_t2`` vs ``sync_t1`` (the same algorithm, threads
  only). Stated in advance: with 3 seeds the 95 % half-width of a paired accuracy difference is about 28 points
  (seed sd about 8.5 points; pairing shares only the prompt order), so no accuracy claim is expected.

* CPU seconds (``cpu_use``, ``cpu_accounting``): from ``train()``'s call to its return, the trainer's process group
  and the server's, the whole machine's busy seconds, the foreign share (busy less ours, in cores) and
  ``/proc/loadavg`` at both ends; the report flags (``--refuse-load``: leaves out) a cell whose foreign share
  exceeds ``--max-foreign-cores`` (0.10). Also recorded: ``torch.get_num_threads()`` at the train start, the CPU
  fingerprint, the lag check (``async_wallclock_checks.lag_check``: the logged ``policy_lag_max`` must be
  min(step - 1, d), 0 when synchronous; a failing cell is kept on disk and left out of the report, listed).

Cost (``--plan``, estimated, not measured): per cell, the committed ``bench_async.py`` runs' median step (steps
2..n, 16 completions) scaled linearly to ``4 x --prompts`` completions, times ``--steps`` (``async_d1_t2``, not
benchmarked there, at ``async_d1``'s step); plus (checked steps other than the last x ``--check-size`` +
``--eval-size``) greedy items at the committed base-model lag cells' seconds per item; plus 60 s of server start.
Each cell is killed (its process group) after ``--cell-timeout-factor`` (3) x that estimate, and the run stops.
The weight copies stay in memory until the evaluation: 0.54 GB each (135M float32 parameters),
10 at the defaults (steps 0-24).

Each finished cell writes ``benchmarks/results/async_wallclock/<setting>_s<seed>/cell.json``, its
``log_history.json`` (TRL's ``trainer.state.log_history``) and its log's tail, committed alone with ``--commit``
(refused while that folder has uncommitted files); a committed cell is skipped (resumable; one of another design
is an error).
``--report-only`` writes ``benchmarks/async_wallclock.png`` and the RESULTS.md section (``async_wallclock_report``);
with another ``--results``, ``RESULTS.md`` and the figure inside that folder instead.

    .venv-vllm/bin/python benchmarks/async_wallclock.py --plan
    .venv-vllm/bin/python benchmarks/async_wallclock.py --commit [--seeds 3]
    .venv-vllm/bin/python benchmarks/async_wallclock.py --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import async_cells as cells  # noqa: E402  (benchmarks/, next to this file)
import async_wallclock_checks as checks  # noqa: E402
import async_wallclock_report as report  # noqa: E402
import cpu_accounting as cpu  # noqa: E402
import policy_lag_experiment as pl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "async_wallclock"
CELL_FILE = "cell.json"
LOG_FILE = "log_history.json"  # TRL's trainer.state.log_history, a few KB
ESTIMATE_PROXY = {"async_d1_t2": "async_d1"}  # --plan's estimate for a setting bench_async has not run
DESIGN_KEYS = ("model", "steps", "prompts", "lr", "train_size", "preset", "engine", "check_every", "check_dense_every",
               "check_dense_until", "check_size", "eval_size", "eval_max_tokens", "eval_threads", "server_spin_s")


def cell_name(setting: str, seed: int) -> str:
    return f"{setting}_s{seed}"


def parse_cell(name: str) -> tuple[str, int]:
    """``<setting>_s<seed>`` -> (setting, seed >= 1).

    Raises:
        ValueError: a malformed name or an unknown setting (the message lists the settings)."""
    setting, _, seed = name.rpartition("_s")
    if setting not in cells.SETTINGS or not seed.isdigit() or int(seed) < 1:
        raise ValueError(f"cell {name!r} is not <setting>_s<seed> (seed >= 1); settings: {list(cells.SETTINGS)}")
    return setting, int(seed)


def cell_order(seeds: int) -> list[str]:
    """Every cell in run order: seed by seed, the settings in ``SETTINGS`` order on odd seeds, reversed on even."""
    order = []
    for seed in range(1, seeds + 1):
        settings = list(cells.SETTINGS) if seed % 2 else list(reversed(cells.SETTINGS))
        order += [cell_name(s, seed) for s in settings]
    return order


def design_of(args: argparse.Namespace) -> dict:
    """The flags that define a cell's result (``DESIGN_KEYS``; the model by its folder name)."""
    return {k: (Path(args.model).name if k == "model" else getattr(args, k)) for k in DESIGN_KEYS}


def pending_cells(results: Path, seeds: int, design: dict) -> list[str]:
    """``cell_order(seeds)`` less the cells whose ``cell.json`` is under ``results`` (resumable).

    Raises:
        RuntimeError: a committed cell of another design (its ``design`` differs from ``design``): its numbers would
            be mixed with this run's; the message names the differing keys and the fix."""
    todo = []
    for name in cell_order(seeds):
        path = results / name / CELL_FILE
        if not path.exists():
            todo.append(name)
            continue
        theirs = checks.recorded_design(json.loads(path.read_text()).get("design", {}))
        diff = sorted(k for k in design if theirs.get(k) != design[k])
        if diff:
            raise RuntimeError(f"{path} ran another design ({', '.join(f'{k}: {theirs.get(k)!r}' for k in diff)}; "
                               f"now {', '.join(f'{k}: {design[k]!r}' for k in diff)}): use another --results folder "
                               "or the committed design's flags.")
    return todo


def check_steps(steps: int, every: int, dense_every: int = 1, dense_until: int = 0) -> list[int]:
    """The evaluated steps: 0, every ``dense_every`` steps up to ``dense_until``, then every ``every`` steps after
    it, before the last, and the last (``steps``). ``dense_until`` 0: every ``every`` steps throughout.

    Raises:
        ValueError: ``steps``, ``every`` or ``dense_every`` below 1, or ``dense_until`` negative."""
    if min(steps, every, dense_every) < 1 or dense_until < 0:
        raise ValueError(f"--steps, --check-every and --check-dense-every must be >= 1 and --check-dense-until >= 0, "
                         f"got {steps}, {every}, {dense_every} and {dense_until}")
    dense = range(0, min(dense_until, steps - 1) + 1, dense_every)
    sparse = range(dense_until + every if dense_until else 0, steps, every)
    return sorted({*dense, *sparse, steps})


def schedule(args: argparse.Namespace) -> list[int]:
    """``check_steps``: ``--steps``, ``--check-every``, ``--check-dense-every``, ``--check-dense-until``."""
    return check_steps(args.steps, args.check_every, args.check_dense_every, args.check_dense_until)


def checkpoint_rows(at_step_end: list[float], evals: dict[int, dict], check_size: int) -> list[dict]:
    """One row per evaluated step, in step order: ``step``, ``train_s`` (training seconds at that step's end, 0 at
    step 0: ``TrainingClock.at_step_end``), ``correct`` / ``total`` on the first ``check_size`` held-out items (for
    the last step: the first ``check_size`` of the final evaluation's scores) and ``eval_s``.

    Raises:
        ValueError: an evaluated step past the clocked steps."""
    rows = []
    for step in sorted(evals):
        if step > len(at_step_end):
            raise ValueError(f"step {step} was evaluated but only {len(at_step_end)} steps were clocked")
        scores = evals[step]["scores"][:check_size]
        rows.append({"step": step, "train_s": 0.0 if step == 0 else at_step_end[step - 1],
                     "correct": int(sum(scores)), "total": len(scores), "eval_s": evals[step]["seconds"]})
    return rows


def code_revision() -> str:
    """``policy_lag_experiment.code_revision`` (HEAD, ``+dirty`` for uncommitted package or recipe changes), also
    ``+dirty`` for uncommitted changes to this experiment's own scripts."""
    rev = pl.code_revision()
    own = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "benchmarks/async_wallclock.py",
                          "benchmarks/async_cells.py", "benchmarks/async_wallclock_report.py"],
                         capture_output=True, text=True).stdout.strip()
    return rev + ("+dirty" if own and not rev.endswith("+dirty") else "")


# ----------------------------------------------------------------------------------------------- inside a cell
def worker(setting: str, seed: int, args: argparse.Namespace, out: Path) -> None:
    """One cell in this process: train with weight copies at the checked steps, then evaluate them; writes
    ``out/log_history.json`` (TRL's ``trainer.state.log_history``) and ``out/cell.json``."""
    import torch

    t_process = time.time()
    threads = cells.set_threads(setting)
    train_task, held_out = cells.main_job_tasks(args.train_size, args.eval_size)
    steps_checked = schedule(args)
    clock, copies, run = cells.TrainingClock(), {}, {}

    def copy_weights(model) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def after_step(state) -> None:
        if state.global_step in steps_checked and state.global_step < args.steps:
            copies[state.global_step] = copy_weights(trainer.model)

    with cells.serve(setting, args.model, args.engine, out / "server.log", spin_s=args.server_spin_s) as server:
        import grpo_recipe_utils as ru  # recipes/, on the path after main_job_tasks

        config = cells.grpo_config(setting, out, server, steps=args.steps, batch=4 * args.prompts, lr=args.lr,
                                   preset=args.preset, seed=41 + seed)
        cls, stamp = cells.clocked_trainer(clock, after_step)
        trainer = cls(model=args.model, reward_funcs=[ru.split_reward_func({"train": train_task})], args=config,
                      train_dataset=ru.split_dataset(train_task, "train"))
        trainer.add_callback(stamp)
        copies[0] = copy_weights(trainer.model)
        groups = {"trainer": os.getpgid(0) if os.getpgid(0) == os.getpid() else -1,
                  "server": -1 if server is None else server.process.pid}  # VLLMServer: its own session
        run["threads_at_train"] = torch.get_num_threads()
        started = cpu.snapshot(groups)
        try:
            trainer.train()
            run["cpu_use"] = cpu.cpu_usage(started, cpu.snapshot(groups))
        finally:
            cells.close(trainer, server)
        run["server_start_s"] = None if server is None else server.startup_s
    if len(clock.at_step_end) != args.steps:
        raise RuntimeError(f"{len(clock.at_step_end)} steps clocked, {args.steps} asked")
    (out / LOG_FILE).write_text(json.dumps(trainer.state.log_history))
    torch.set_num_threads(args.eval_threads)
    final = pl.greedy_eval(trainer, held_out, args.eval_size, args.eval_max_tokens)
    evals = {args.steps: final}
    for step, weights in sorted(copies.items()):
        trainer.model.load_state_dict(weights)
        evals[step] = pl.greedy_eval(trainer, held_out, min(args.check_size, args.eval_size), args.eval_max_tokens)
    record = cell_record(setting, seed, args, clock, trainer, evals, run)
    record.update(threads=threads, process_wall_s=round(time.time() - t_process, 1))
    (out / CELL_FILE).write_text(json.dumps(record, indent=1))


def cell_record(setting: str, seed: int, args: argparse.Namespace, clock, trainer, evals: dict, run: dict) -> dict:
    """The cell's ``cell.json`` fields (see the module docstring), its lag check included."""
    depth = cells.SETTINGS[setting][0]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rows = cells.step_rows(depth, clock.step_s, logs, trainer.generate_s)
    for row, at in zip(rows, clock.at_step_end):
        row["clock_s"] = at
    final = evals[args.steps]
    return {"cell": cell_name(setting, seed), "setting": setting, "seed": seed, "depth": depth,
            "server_threads": cells.SETTINGS[setting][2], "design": design_of(args), "code": code_revision(),
            "cpu": pl.cpu_fingerprint(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **run,
            "excluded_s": clock.excluded_s, "lag_check": checks.lag_check(logs, depth, args.steps), "steps": rows,
            "checkpoints": checkpoint_rows(clock.at_step_end, evals, args.check_size),
            "final": {k: final[k] for k in ("correct", "total", "scores", "seconds")}}


# ----------------------------------------------------------------------------------------------- the runner
def worker_command(name: str, args: argparse.Namespace) -> list[str]:
    """The cell's process: this script with ``--worker`` and every design flag."""
    setting, seed = parse_cell(name)
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DESIGN_KEYS]
    return [sys.executable, str(Path(__file__).resolve()), "--worker", setting, "--seed-index", str(seed),
            "--out", str(args.out), *flags]


def run_worker(cmd: list[str], log_path: Path, timeout_s: float) -> int:
    """Run the cell's process in its own process group, its output to ``log_path``; returns its exit code.

    Raises:
        CellTimeout: no exit within ``timeout_s`` seconds: the whole group is killed first (SIGKILL; the vLLM server,
            in its own session, stops itself within about 10 s: ``vllm_launch.watch_parent`` sees its parent die)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise CellTimeout(f"no result after {timeout_s:.0f} s: killed its process group; see {log_path} (raise "
                              "--cell-timeout-factor or set --cell-timeout if the cell was only slow)") from None
        except BaseException:  # Ctrl-C: leave no cell behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


class CellTimeout(RuntimeError):
    """A cell's process ran past its timeout (``run_worker``)."""


def run_cell(name: str, args: argparse.Namespace, timeout_s: float) -> bool:
    """Run one cell in a fresh process (killed after ``timeout_s``: ``run_worker``); keep ``log_history.json``,
    ``cell.json`` (last: its presence marks the cell done) and the log's tail under ``--results`` and
    (``--commit``) commit them. False when the process failed (its ``run.log`` stays under ``--out``)."""
    out, results = Path(args.out) / name, Path(args.results) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / CELL_FILE).unlink(missing_ok=True)
    cmd = worker_command(name, args)
    print(f">>> {name} (timeout {timeout_s:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    rc = run_worker(cmd, out / "run.log", timeout_s)
    if rc or not (out / CELL_FILE).exists():
        print(f"!!! {name}: rc {rc}; see {out / 'run.log'}", flush=True)
        return False
    results.mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / LOG_FILE, results / LOG_FILE)
    (results / "run_tail.log").write_text("\n".join((out / "run.log").read_text().splitlines()[-40:]) + "\n")
    shutil.copy2(out / CELL_FILE, results / CELL_FILE)
    rec = json.loads((results / CELL_FILE).read_text())
    lag = "lag check passed" if not rec["lag_check"] else f"LAG CHECK FAILED ({len(rec['lag_check'])} problems)"
    summary = (f"{rec['final']['correct']}/{rec['final']['total']} after {rec['steps'][-1]['clock_s']:.0f} "
               f"training s, {time.time() - t0:.0f} s wall, {lag}, foreign load "
               f"{rec['cpu_use']['foreign_cores']:.2f} cores")
    print(f"<<< {name}: {summary}", flush=True)
    if args.commit:
        pl.commit_cell(Path(args.results), name, summary)
    return True


def uncommitted_problem(porcelain: str, folder: Path) -> str | None:
    """The refusal for ``--commit`` when ``git status --porcelain -- folder`` (``porcelain``) lists files (a cell
    copied but not committed, or edited): its message names them and the fix; None when clean."""
    lines = [line for line in porcelain.splitlines() if line.strip()]
    if not lines:
        return None
    return (f"{folder} has uncommitted cell files ({'; '.join(lines[:5])}{' ...' if len(lines) > 5 else ''}): "
            f"commit them (git add {folder} && git commit) or remove them (git checkout / git clean -- {folder}) "
            "before running with --commit, so that each commit holds one cell.")


def cell_timeouts(args: argparse.Namespace) -> dict[str, float]:
    """{setting: seconds}: ``--cell-timeout`` for every setting, else ``--cell-timeout-factor`` x ``estimate``.

    Raises:
        SystemExit: no ``--cell-timeout`` and no committed runs to estimate from (names the flag)."""
    if args.cell_timeout:
        return {s: float(args.cell_timeout) for s in cells.SETTINGS}
    try:
        per_cell, _ = estimate(args)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}: set --cell-timeout SECONDS") from None
    return {s: args.cell_timeout_factor * v for s, v in per_cell.items()}


def estimate(args: argparse.Namespace, bench=ROOT / "benchmarks" / "results" / "bench_async",
             evals=ROOT / "benchmarks" / "results" / "async_lag" / "base_16x4") -> tuple[dict[str, float], str]:
    """Estimated seconds of one cell per setting, and how: the committed ``bench_async.py`` runs' median step (steps
    2..n, median over rounds; 16 completions a step) scaled linearly to ``4 x --prompts`` completions, times
    ``--steps``; plus the greedy evaluations at the committed base-model cells' seconds per item (1 thread, another
    cell beside them: an upper bound at ``--eval-threads`` 2); plus 60 s for the server's start (LOG.md: 29-48 s).
    Not measured for this design. Raises FileNotFoundError where the committed runs are missing."""
    per_item = []
    for curve in sorted(evals.glob("*/curve.jsonl")):
        rows = [json.loads(line) for line in curve.read_text().splitlines() if line.strip()]
        per_item += [r["seconds"] / r["total"] for r in rows if r.get("total")]
    eval_items = (len(schedule(args)) - 1) * args.check_size + args.eval_size
    eval_s = statistics.median(per_item) * eval_items
    out, proxies = {}, []
    for setting in cells.SETTINGS:
        runs = [json.loads(p.read_text()) for p in sorted(bench.glob(f"round*/{setting}.json"))]
        if not runs and setting in ESTIMATE_PROXY:  # not benchmarked: its proxy's step
            proxies.append(f"{setting} as {ESTIMATE_PROXY[setting]}")
            runs = [json.loads(p.read_text()) for p in sorted(bench.glob(f"round*/{ESTIMATE_PROXY[setting]}.json"))]
        if not runs:
            raise FileNotFoundError(f"no committed bench_async run of {setting} under {bench}")
        step = statistics.median(statistics.median(r["step_s"] for r in run["steps"][1:]) for run in runs)
        out[setting] = step * 4 * args.prompts / 16 * args.steps + eval_s + 60
    how = (f"bench_async's committed median steps x {4 * args.prompts}/16 completions x {args.steps} steps + "
           f"{eval_items} greedy items at {statistics.median(per_item):.2f} s each + 60 s server start"
           + (f" (not benchmarked, estimated from another setting's step: {', '.join(proxies)})" if proxies else ""))
    return out, how


def plan(args: argparse.Namespace) -> None:
    todo = pending_cells(Path(args.results), args.seeds, design_of(args))
    per_cell, how = estimate(args)
    timeouts = cell_timeouts(args)
    for name in cell_order(args.seeds):
        state = "to run" if name in todo else "committed"
        setting = parse_cell(name)[0]
        print(f"{name:14s} {state:9s} ~{per_cell[setting] / 60:.0f} min (killed after {timeouts[setting] / 60:.0f})")
    left = sum(per_cell[parse_cell(n)[0]] for n in todo)
    print(f"{len(todo)} cells to run, ~{left / 3600:.1f} h wall on both cores ({2 * left / 3600:.1f} core-h); "
          f"estimated, not measured: {how}; checks at steps {schedule(args)}, weight copies ~"
          f"{0.54 * (len(schedule(args)) - 1):.1f} GB in memory")


def _spin_seconds(value: str) -> float:
    """``--server-spin-s``: the seconds as the server's plugin reads them (``engines/vllm_spin.parse_spin``).

    Raises:
        argparse.ArgumentTypeError: not a finite number >= 0 (the plugin's message, naming the fix)."""
    from trl_rollout_corr.engines.vllm_spin import parse_spin

    try:
        return parse_spin(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=pl.BASE_MODEL, help="the start (default: the base SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=32, help="optimizer steps per cell")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (4 completions each)")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--train-size", type=int, default=2000, help="training problems (the main job's 2000)")
    ap.add_argument("--preset", default=cells.DEFAULT_PRESET, help="the correction preset of every setting")
    ap.add_argument("--engine", choices=["server", "transformers"], default="server",
                    help="server: TRL's vLLM server (the real pipeline); transformers: a smoke path, other generators")
    ap.add_argument("--server-spin-s", type=_spin_seconds, default=0.0,
                    help="the vLLM server's queue busy-wait, s (TRL_ROLLOUT_CORR_VLLM_SPIN_S; 1.0 = vLLM's default, "
                    "which keeps a second core busy while it generates; cells before 2026-12-07 16:00 ran with it)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..n of every setting")
    ap.add_argument("--check-every", type=int, default=8, help="check every this many steps after the dense part")
    ap.add_argument("--check-dense-every", type=int, default=2, help="check every this many steps up to ...")
    ap.add_argument("--check-dense-until", type=int, default=16, help="... this step (0: no dense part)")
    ap.add_argument("--check-size", type=int, default=128)
    ap.add_argument("--eval-size", type=int, default=512)
    ap.add_argument("--eval-max-tokens", type=int, default=32, help="greedy budget (the training cap)")
    ap.add_argument("--eval-threads", type=int, default=2,
                    help="torch threads of the post-training evaluation (1 on a busy machine: 2 OpenMP threads on "
                    "an oversubscribed CPU wait at every matmul's barrier)")
    ap.add_argument("--reach-points", type=float, default=5.0, help="time-to-reach target: start + this, points")
    ap.add_argument("--cell-timeout-factor", type=float, default=3.0,
                    help="kill a cell (its process group) after this many times its --plan estimate")
    ap.add_argument("--cell-timeout", type=float, help="kill a cell after this many seconds (instead of the factor)")
    ap.add_argument("--max-foreign-cores", type=float, default=0.10,
                    help="the report flags a cell whose other processes used more cores than this on average")
    ap.add_argument("--refuse-load", action="store_true", help="the report leaves those cells out instead")
    ap.add_argument("--cells", help="comma list of cells to run (default: every pending cell, in run order)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "async_wallclock"), help="cell working folders")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--commit", action="store_true", help="git commit each finished cell's results folder")
    ap.add_argument("--plan", action="store_true", help="print the cells and their estimated cost, exit")
    ap.add_argument("--report-only", action="store_true", help="write the figure and the RESULTS.md section, exit")
    ap.add_argument("--worker", choices=list(cells.SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--seed-index", type=int, default=1, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def report_paths(results: Path) -> dict[str, Path]:
    """Where ``--report-only`` writes: benchmarks/RESULTS.md and benchmarks/async_wallclock.png for the committed
    cells (``RESULTS``), else ``<results>/RESULTS.md`` and ``<results>/async_wallclock.png`` (a smoke run's report
    never overwrites the committed section or figure)."""
    if results.resolve() == RESULTS.resolve():
        return {"results_md": report.RESULTS_MD, "figure": report.FIGURE}
    return {"results_md": results / "RESULTS.md", "figure": results / report.FIGURE.name}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed_index, args, Path(args.out) / cell_name(args.worker, args.seed_index))
        return
    if args.report_only:
        report.write(Path(args.results), cell_order(args.seeds), design_of(args), args.reach_points,
                     max_foreign_cores=args.max_foreign_cores, refuse_load=args.refuse_load,
                     **report_paths(Path(args.results)))
        return
    if args.plan:
        plan(args)
        return
    todo = pending_cells(Path(args.results), args.seeds, design_of(args))
    if args.cells:  # in the order given; committed ones skipped
        wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
        seeds = max([args.seeds, *(parse_cell(c)[1] for c in wanted)])
        todo = [c for c in wanted if c in pending_cells(Path(args.results), seeds, design_of(args))]
    if args.commit:
        git = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", str(args.results)],
                             capture_output=True, text=True, check=True)
        problem = uncommitted_problem(git.stdout, Path(args.results))
        if problem:
            raise SystemExit(problem)
    timeouts = cell_timeouts(args)
    failed = [name for name in todo if not run_cell(name, args, timeouts[parse_cell(name)[0]])]
    if failed:
        raise SystemExit(f"cells failed: {', '.join(failed)} (their run.log under {args.out})")


if __name__ == "__main__":
    main()
