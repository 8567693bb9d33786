#!/usr/bin/env python
"""Benchmark: time and peak memory of the full rollout correction on CPU.

What is measured, per shape (B, T), float32, CPU, ``torch.set_num_threads(1)``:

* ``floor``: one fused pass over the same inputs, ``((old - rollout).exp() * mask).sum()``.
* ``ours``: ``compute_rollout_correction(old, rollout, mask, cfg)`` **plus** ``out.metrics`` (the metrics
  dict is finalised to Python floats inside the timed region: that is the full cost a trainer pays).
* ``verl``: verl 0.9.1 ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask``
  with the equivalent arguments (its metrics are already Python floats when it returns). verl runs in a
  separate venv (``benchmarks/setup_verl_venv.sh``), so it is timed in subprocesses.

Config (both sides): token TIS U=2.0, batch normalisation on, ``rollout_rs="token_k1,seq_mean_k3"``,
``rollout_rs_threshold="0.5_2.0,0.01"`` (a symmetric ratio band [0.5, 2] for token_k1, so our "band as
written" and verl's ``[1/U, 1/L]`` agree; seq_mean_k3 <= 0.01, the top of the usual 0.001..0.01 range).

Method:

* Inputs are generated from a fixed seed with a private ``torch.Generator`` by this same file in both
  venvs (same torch 2.13.0, so bit-identical; a checksum is printed and checked).
* Time: every worker subprocess generates the inputs, calls the implementation once (reported as the first-call
  time: it includes torch.compile for ``ours_compiled``), warms up, then alternates ``floor`` and the
  implementation ``--repeats`` times (so the floor ratio is from one process, interleaved), recording wall time
  (``perf_counter``), the thread's CPU time (``thread_time``: excludes time descheduled by other users of a shared
  machine) and minor page faults. The driver alternates rounds of [ours, (ours_compiled,) verl] workers (order
  flipped every round) and reports the median over rounds of the per-round ratio, the ratio of the minima, and a
  "pooled" floor (median over all workers of the shape; the floor's own temporaries page-fault after some calls).
* Peak memory: a fresh subprocess per measurement, started with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed
  threshold disables glibc's dynamic threshold, so every tensor >= 128 KiB is its own mmap and is returned
  to the OS on free: RSS then tracks live tensor memory). After creating the inputs and one warm-up call
  (result freed), the worker records VmRSS, resets the kernel's high-water mark (``echo 5 >
  /proc/self/clear_refs``), runs the call once (outputs kept alive) and reads VmHWM. Reported: VmHWM - VmRSS
  (extra peak of the call, including its returned tensors), median of ``--mem-reps`` fresh processes.
* Agreement: the verl worker saves its weights / mask / metrics; the driver compares them with ours
  (weights and metrics to 1e-4 relative, masks exactly) and lists every shared metric key that differs.

Usage (from the repo root, main venv for ours, the verl venv found at .venv-verl):

    bash benchmarks/setup_verl_venv.sh        # once
    .venv/bin/python benchmarks/bench_correction.py --ours-rev HEAD --compiled --write-results benchmarks/RESULTS.md

``--ours-rev REV`` benchmarks trl_rollout_corr as committed at REV (``git archive`` to a temp dir), ``--ours-src DIR``
a checkout at DIR; ``--no-verl`` skips verl; ``--json``/``--from-json`` save / re-render a report.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VERL_PY = os.path.join(REPO, ".venv-verl", "bin", "python")

CFG = dict(
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=True,
    rollout_rs="token_k1,seq_mean_k3",
    rollout_rs_threshold="0.5_2.0,0.01",
)

# ----------------------------------------------------------------------------------------------------------
# inputs


def make_inputs(B: int, T: int, seed: int = 0, mask_dtype: str = "float32"):
    """Realistic (old, rollout, mask), identical in every process/venv with the same torch version.

    * rollout log-probs: ``-U(0, 3)`` nats per token.
    * old = rollout + N(0, 0.03) (bf16-engine-like mismatch), except: 10% of rows "drift" with sigma 0.2
      (their seq_mean_k3 ~ 0.02 > 0.01, so seq RS rejects them), and 0.02% of tokens are outliers with
      |l| in U(0.5, 2.0) (exercise TIS truncation at 2.0 and the token_k1 band [0.5, 2]).
    * mask: right-padded, response length per row ~ U{T/8, ..., T} (no empty rows); padding log-probs 0.0.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + B * 10_007 + T)
    rollout = -3.0 * torch.rand(B, T, generator=g)
    drift = torch.rand(B, 1, generator=g) < 0.10
    sigma = torch.where(drift, torch.tensor(0.2), torch.tensor(0.03))
    noise = torch.randn(B, T, generator=g) * sigma
    outlier = torch.rand(B, T, generator=g) < 0.0002
    mag = 0.5 + 1.5 * torch.rand(B, T, generator=g)
    sign = torch.where(torch.rand(B, T, generator=g) < 0.5, -1.0, 1.0)
    noise = torch.where(outlier, mag * sign, noise)
    old = rollout + noise
    lengths = torch.randint(T // 8, T + 1, (B,), generator=g)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    zero = torch.zeros(())
    old = torch.where(valid, old, zero).contiguous()
    rollout = torch.where(valid, rollout, zero).contiguous()
    mask = valid.to(getattr(torch, mask_dtype))
    return old, rollout, mask


def checksum(*ts) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# the three callables (each returns something to keep alive; all host-side materialisation is inside)


def get_fn(impl: str):

    if impl == "floor":

        def fn(old, rollout, mask):
            return ((old - rollout).exp() * mask).sum().item()

        return fn
    if impl == "ours":
        sys.path.insert(0, os.environ.get("BENCH_OURS_SRC", REPO))  # a checkout to benchmark (default: this repo)
        from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction

        cfg = RolloutCorrectionConfig(**CFG)

        def fn(old, rollout, mask):
            out = compute_rollout_correction(old, rollout, mask, cfg)
            metrics = out.metrics  # finalised to Python floats: part of the timed cost
            return out.weights, out.response_mask, metrics, out

        return fn
    if impl == "ours_compiled":
        sys.path.insert(0, os.environ.get("BENCH_OURS_SRC", REPO))
        from trl_rollout_corr import RolloutCorrectionConfig
        from trl_rollout_corr.correction import compiled_rollout_correction

        compiled = compiled_rollout_correction(RolloutCorrectionConfig(**CFG))

        def fn(old, rollout, mask):
            out = compiled(old, rollout, mask)
            metrics = out.metrics
            return out.weights, out.response_mask, metrics, out

        return fn
    if impl == "verl":
        import warnings

        warnings.filterwarnings("ignore")
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        def fn(old, rollout, mask):
            w_proto, new_mask, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **CFG)
            return w_proto.batch["rollout_is_weights"], new_mask, metrics, w_proto

        return fn
    raise ValueError(impl)


# ----------------------------------------------------------------------------------------------------------
# worker (runs in either venv)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def worker(args) -> dict:
    import torch

    torch.set_num_threads(1)
    old, rollout, mask = make_inputs(args.B, args.T, args.seed, args.mask_dtype)
    fn = get_fn(args.worker)
    res = {
        "impl": args.worker,
        "B": args.B,
        "T": args.T,
        "checksum": checksum(old, rollout, mask),
        "torch": torch.__version__,
    }

    if args.mode == "time":
        floor = get_fn("floor")
        t0 = time.perf_counter()
        r = fn(old, rollout, mask)  # first call (includes torch.compile for ours_compiled)
        res["first_call_s"] = time.perf_counter() - t0
        del r
        for _ in range(args.warmup):
            floor(old, rollout, mask)
            r = fn(old, rollout, mask)
            del r
        import resource

        t_floor, t_impl, c_floor, c_impl, f_floor, f_impl = [], [], [], [], [], []
        pc, tt = time.perf_counter, time.thread_time

        def flt():
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        for _ in range(args.repeats):
            f0, c0, t0 = flt(), tt(), pc()
            floor(old, rollout, mask)
            f1, c1, t1 = flt(), tt(), pc()
            r = fn(old, rollout, mask)
            f2, c2, t2 = flt(), tt(), pc()
            del r
            f_floor.append(f1 - f0)
            f_impl.append(f2 - f1)
            t_floor.append(t1 - t0)
            t_impl.append(t2 - t1)
            c_floor.append(c1 - c0)
            c_impl.append(c2 - c1)
        res.update(
            t_floor=t_floor,
            t_impl=t_impl,
            c_floor=c_floor,
            c_impl=c_impl,
            faults_floor=med(f_floor),
            faults_impl=med(f_impl),
        )
    elif args.mode == "mem":
        r = fn(old, rollout, mask)  # warm-up (lazy init, first-call allocations)
        del r
        gc.collect()
        rss0 = _proc_status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            method = "clear_refs"
        except OSError:
            method = "ru_maxrss"
            import resource

            hwm_ru0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = fn(old, rollout, mask)
        if method == "clear_refs":
            hwm = _proc_status_kib("VmHWM")
        else:
            import resource

            hwm = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, hwm_ru0)
        rss1 = _proc_status_kib("VmRSS")
        res.update(
            method=method,
            rss0_kib=rss0,
            peak_extra_kib=hwm - rss0,
            retained_kib=rss1 - rss0,
            malloc_env=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        )
        del r
    elif args.mode == "dump":
        w, m, metrics, _ = fn(old, rollout, mask)
        torch.save({"weights": w.clone(), "mask": m.clone(), "metrics": dict(metrics)}, args.dump)
    return res


# ----------------------------------------------------------------------------------------------------------
# driver


# --baseline-rev: the same workers, importing trl_rollout_corr from the baseline checkout
_BASELINE_WORKERS = {"base": "ours", "base_compiled": "ours_compiled"}


def run_worker(python, impl, mode, B, T, args, env_extra=None, dump=None) -> dict:
    if impl in _BASELINE_WORKERS:
        env_extra = {**(env_extra or {}), "BENCH_OURS_SRC": args.baseline_src}
        res = run_worker(python, _BASELINE_WORKERS[impl], mode, B, T, args, env_extra=env_extra, dump=dump)
        return {**res, "impl": impl}
    cmd = [
        python,
        os.path.abspath(__file__),
        "--worker",
        impl,
        "--mode",
        mode,
        "--B",
        str(B),
        "--T",
        str(T),
        "--seed",
        str(args.seed),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--mask-dtype",
        args.mask_dtype,
    ]
    if dump:
        cmd += ["--dump", dump]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        VERL_USE_EXTERNAL_PLUGINS="none",
        RAY_DEDUP_LOGS="0",
    )
    if env_extra:
        env.update(env_extra)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"worker {impl}/{mode} {B}x{T} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def med(xs):
    return statistics.median(xs)


def compare(ours, verl) -> dict:
    """Weights/mask/metric agreement of ours vs verl on identical inputs."""

    w_o, w_v = ours["weights"].double(), verl["weights"].double()
    m_o, m_v = ours["mask"].double(), verl["mask"].double()
    w_rel = ((w_o - w_v).abs() / w_v.abs().clamp_min(1e-12)).max().item()
    mask_diff = int((m_o != m_v).sum().item())
    mo, mv = ours["metrics"], verl["metrics"]
    shared = sorted(set(mo) & set(mv))
    diffs = []
    for k in shared:
        a, b = float(mo[k]), float(mv[k])
        rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
        if not (abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-7):
            diffs.append((k, a, b, rel))
    return dict(
        weights_max_rel=w_rel,
        mask_mismatches=mask_diff,
        n_shared=len(shared),
        diffs=diffs,
        only_ours=sorted(set(mo) - set(mv)),
        only_verl=sorted(set(mv) - set(mo)),
        rejected_frac_verl=mv.get("rollout_corr/rollout_rs_masked_fraction"),
        seq_rejected_frac_verl=mv.get("rollout_corr/rollout_rs_seq_masked_fraction"),
    )


def driver(args):
    import torch

    torch.set_num_threads(1)
    ours_desc = _describe_ours(args)
    if args.ours_src:
        os.environ["BENCH_OURS_SRC"] = os.path.abspath(args.ours_src)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    have_verl = os.path.exists(args.verl_python) and not args.no_verl
    impls = ["ours"] + (["ours_compiled"] if args.compiled else []) + (["verl"] if have_verl else [])
    if args.no_ours:
        impls = [i for i in impls if i != "ours"]
    baseline_desc = None
    if args.baseline_rev:  # interleaved in the same rounds as ours: before/after under the same machine load
        baseline_desc, args.baseline_src = _export_rev(args.baseline_rev)
        impls = ["base"] + impls[:1] + (["base_compiled"] if args.compiled else []) + impls[1:]
    pythons = {
        "ours": sys.executable,
        "ours_compiled": sys.executable,
        "base": sys.executable,
        "base_compiled": sys.executable,
        "verl": args.verl_python,
        "floor": sys.executable,
    }
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    report = {"shapes": {}, "impls": impls}

    for B, T in shapes:
        print(f"\n=== (B, T) = ({B}, {T}) ===", flush=True)
        sh = {}
        # --- time: rounds of [ours, verl] subprocesses, order flipped each round
        per = {i: [] for i in impls}
        for r in range(args.rounds):
            order = impls if r % 2 == 0 else impls[::-1]
            for impl in order:
                res = run_worker(pythons[impl], impl, "time", B, T, args)
                per[impl].append(res)
                print(
                    f"  round {r} {impl:5s}: wall {med(res['t_impl']) * 1e3:8.2f} ms "
                    f"(floor {med(res['t_floor']) * 1e3:6.3f}, "
                    f"x{med(res['t_impl']) / med(res['t_floor']):6.1f})  cpu {med(res['c_impl']) * 1e3:8.2f} ms "
                    f"(floor {med(res['c_floor']) * 1e3:6.3f}, "
                    f"x{med(res['c_impl']) / med(res['c_floor']):6.1f})  [{res['checksum']}]",
                    flush=True,
                )
        sums = {res["checksum"] for i in impls for res in per[i]}
        assert len(sums) == 1, f"inputs differ between workers: {sums}"
        for impl in impls:
            sh[impl] = {}
            for clk in ("t", "c"):  # t: wall clock (perf_counter), c: this thread's CPU time (thread_time)
                meds = [med(x[clk + "_impl"]) for x in per[impl]]
                fl = [med(x[clk + "_floor"]) for x in per[impl]]
                mn = min(min(x[clk + "_impl"]) for x in per[impl])
                fmn = min(min(x[clk + "_floor"]) for x in per[impl])
                sh[impl][clk] = dict(
                    med=med(meds),
                    min=mn,
                    floor_med=med(fl),
                    floor_min=fmn,
                    x_floor=med([m / f for m, f in zip(meds, fl)]),
                    x_floor_min=mn / fmn,
                )
        pooled = {clk: med([med(x[clk + "_floor"]) for i in impls for x in per[i]]) for clk in ("t", "c")}
        sh["floor_pooled"] = pooled
        for impl in impls:
            sh[impl]["first_call_s"] = med([x["first_call_s"] for x in per[impl]])
            sh[impl]["x_floor_pooled_c"] = sh[impl]["c"]["med"] / pooled["c"]
            sh[impl]["faults_impl"] = med([x["faults_impl"] for x in per[impl]])
            sh[impl]["faults_floor"] = med([x["faults_floor"] for x in per[impl]])
        if "ours_compiled" in impls and "verl" in impls:
            sh["compiled_ratio_c"] = med(
                [med(o["c_impl"]) / med(v["c_impl"]) for o, v in zip(per["ours_compiled"], per["verl"])]
            )
        if "ours" in impls and "verl" in impls:
            for clk in ("t", "c"):
                ratios = [med(o[clk + "_impl"]) / med(v[clk + "_impl"]) for o, v in zip(per["ours"], per["verl"])]
                sh["ratio_" + clk] = dict(
                    med=med(ratios), rounds=ratios, min=sh["ours"][clk]["min"] / sh["verl"][clk]["min"]
                )
        # --- memory: fresh processes, interleaved
        mem = {i: [] for i in ["floor"] + impls}
        env = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
        for _ in range(args.mem_reps):
            for impl in ["floor"] + impls:
                res = run_worker(pythons[impl], impl, "mem", B, T, args, env_extra=env)
                mem[impl].append(res)
        for impl in ["floor"] + impls:
            pk = med([x["peak_extra_kib"] for x in mem[impl]]) / 1024
            rt = med([x["retained_kib"] for x in mem[impl]]) / 1024
            sh.setdefault(impl, {}).update(peak_mib=pk, retained_mib=rt, mem_method=mem[impl][0]["method"])
            print(f"  mem {impl:5s}: extra peak {pk:8.2f} MiB  retained {rt:8.2f} MiB  ({mem[impl][0]['method']})")
        if "ours" in impls and "verl" in impls:
            sh["mem_ratio"] = sh["ours"]["peak_mib"] / max(sh["verl"]["peak_mib"], 1e-9)
        if "ours_compiled" in impls and "verl" in impls:
            sh["compiled_mem_ratio"] = sh["ours_compiled"]["peak_mib"] / max(sh["verl"]["peak_mib"], 1e-9)
        sh["input_mib"] = 3 * B * T * 4 / 2**20
        sh["valid_tokens"] = int(make_inputs(B, T, args.seed, args.mask_dtype)[2].sum().item())
        # --- agreement
        if "ours" in impls and "verl" in impls:
            with tempfile.TemporaryDirectory() as td:
                pv, po = os.path.join(td, "verl.pt"), os.path.join(td, "ours.pt")
                run_worker(pythons["verl"], "verl", "dump", B, T, args, dump=pv)
                run_worker(pythons["ours"], "ours", "dump", B, T, args, dump=po)
                sh["agree"] = compare(torch.load(po, weights_only=False), torch.load(pv, weights_only=False))
            a = sh["agree"]
            print(
                f"  agreement: weights max rel {a['weights_max_rel']:.2e}, mask mismatches {a['mask_mismatches']}, "
                f"{a['n_shared']} shared keys, {len(a['diffs'])} differ"
            )
            for k, x, y, rel in a["diffs"]:
                print(f"    DIFF {k}: ours {x!r} verl {y!r} rel {rel:.2e}")
        elif "verl" in impls:
            with tempfile.TemporaryDirectory() as td:
                pv = os.path.join(td, "verl.pt")
                run_worker(pythons["verl"], "verl", "dump", B, T, args, dump=pv)
                m = torch.load(pv, weights_only=False)["metrics"]
                sh["verl_rs"] = (
                    m["rollout_corr/rollout_rs_masked_fraction"],
                    m["rollout_corr/rollout_rs_seq_masked_fraction"],
                    len(m),
                )
                print(f"  verl: rs masked fraction {sh['verl_rs'][0]:.4f}, seq {sh['verl_rs'][1]:.4f}, {len(m)} keys")
        report["shapes"][f"{B}x{T}"] = sh

    report.update(
        started=started.strftime("%Y-%m-%d %H:%M UTC"),
        load_before=load0,
        load_after=os.getloadavg(),
        torch=torch.__version__,
        python=platform.python_version(),
        ours=ours_desc,
        baseline=baseline_desc,
        cpus=os.cpu_count(),
        cpu_model=_cpu_model(),
        args=vars(args),
        cmd=" ".join(["python"] + sys.argv[0:1] + sys.argv[1:]),
    )
    md = to_markdown(report)
    print("\n" + md)
    if args.write_results:
        write_results(args.write_results, md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def _describe_ours(args) -> str:
    """Resolve --ours-rev (export that revision to a temp dir) and describe what 'ours' is."""

    def git(*a, cwd=REPO):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=cwd).stdout.strip()

    if args.ours_rev:
        desc, args.ours_src = _export_rev(args.ours_rev, "--ours-rev")
        return desc
    if args.ours_src:
        return f"trl_rollout_corr from {args.ours_src}"
    rev = git("log", "-1", "--format=%h", "HEAD", "--", "trl_rollout_corr")
    dirty = git("status", "--porcelain", "trl_rollout_corr")
    return f"trl_rollout_corr working tree at {rev}" + (" with uncommitted changes" if dirty else "")


def _export_rev(rev_arg: str, flag: str = "--baseline-rev") -> tuple[str, str]:
    """``git archive`` the package at a revision into a temp dir; returns (description, directory)."""

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()

    rev = git("rev-parse", "--short", rev_arg)
    dest = tempfile.mkdtemp(prefix=f"bench-{rev}-")
    archive = subprocess.run(
        ["git", "archive", rev_arg, "trl_rollout_corr"], capture_output=True, cwd=REPO, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    last = git("log", "-1", "--format=%h", rev_arg, "--", "trl_rollout_corr")
    return f"trl_rollout_corr at commit {rev} (`{flag} {rev_arg}`; package last changed in {last})", dest


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def to_markdown(rep) -> str:
    L = []
    L.append(
        f"Run: `{rep['cmd']}` at {rep['started']}; ours = {rep['ours']}; "
        + (f"base = {rep['baseline']}; " if rep.get("baseline") else "")
        + f"torch {rep['torch']}, "
        f"Python {rep['python']}, "
        f"{rep['cpus']} cores ({rep['cpu_model']}), `torch.set_num_threads(1)`, float32, CPU. "
        f"Load average before/after: {rep['load_before'][0]:.2f} / {rep['load_after'][0]:.2f} "
        f"(the machine is shared). Rounds: {rep['args']['rounds']} x (warmup {rep['args']['warmup']} + "
        f"{rep['args']['repeats']} repeats), memory: median of {rep['args']['mem_reps']} fresh processes."
    )
    L.append("")
    L.append(
        "Times are per call. *wall* = `time.perf_counter`, *cpu* = `time.thread_time` of the (single) compute "
        "thread, which excludes time the thread was descheduled by other users of the shared CPU; medians over "
        "rounds of each worker's median, and minima over all repeats."
    )
    L.append("")
    L.append(
        "*x floor* divides by the floor timed in the same worker process, interleaved call by call; *x pooled "
        "floor* divides by the median floor over all workers of that shape (the floor's own cost depends on the "
        "allocator state the other call leaves behind: its temporaries page-fault after some calls, see the "
        "minor-fault columns)."
    )
    L.append("")
    L.append(
        "| (B, T) | impl | wall median (ms) | wall min (ms) | cpu median (ms) | cpu min (ms) | x floor, wall | "
        "x floor, cpu | x floor, cpu min/min | x pooled floor, cpu | minor faults / call (impl; floor) | "
        "extra peak RSS (MiB) | retained (MiB) |"
    )
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, sh in rep["shapes"].items():
        B, T = key.split("x")
        fl = sh[rep["impls"][0]]
        L.append(
            f"| ({B}, {T}) | floor | {fl['t']['floor_med'] * 1e3:.3f} | {fl['t']['floor_min'] * 1e3:.3f} | "
            f"{fl['c']['floor_med'] * 1e3:.3f} | {fl['c']['floor_min'] * 1e3:.3f} | 1 | 1 | 1 | 1 (pooled "
            f"{sh['floor_pooled']['c'] * 1e3:.3f} ms) | | {sh['floor']['peak_mib']:.1f} | "
            f"{sh['floor']['retained_mib']:.1f} |"
        )
        for impl in rep["impls"]:
            s, t, c = sh[impl], sh[impl]["t"], sh[impl]["c"]
            L.append(
                f"| ({B}, {T}) | {impl} | {t['med'] * 1e3:.2f} | {t['min'] * 1e3:.2f} | {c['med'] * 1e3:.2f} | "
                f"{c['min'] * 1e3:.2f} | {t['x_floor']:.1f} | {c['x_floor']:.1f} | {c['x_floor_min']:.1f} | "
                f"{s['x_floor_pooled_c']:.1f} | {s['faults_impl']:.0f}; {s['faults_floor']:.0f} | "
                f"{s['peak_mib']:.2f} | {s['retained_mib']:.2f} |"
            )
    L.append("")
    if all("ratio_t" in sh for sh in rep["shapes"].values()):
        L.append(
            "| (B, T) | inputs (MiB) | valid tokens | ours/verl wall (median of rounds) | ours/verl cpu (median "
            "of rounds) | ours/verl cpu min/min | ours/verl extra peak RSS | ours/floor cpu | weights max rel diff | "
            "mask mismatches | shared metric keys differing (> 1e-4 rel) |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for key, sh in rep["shapes"].items():
            B, T = key.split("x")
            a = sh["agree"]
            d = ", ".join(f"`{k}`" for k, *_ in a["diffs"]) or f"none of {a['n_shared']}"
            L.append(
                f"| ({B}, {T}) | {sh['input_mib']:.0f} | {sh['valid_tokens']} | {sh['ratio_t']['med']:.2f} | "
                f"{sh['ratio_c']['med']:.2f} | {sh['ratio_c']['min']:.2f} | {sh['mem_ratio']:.4f} | "
                f"{sh['ours']['c']['x_floor']:.1f} | {a['weights_max_rel']:.1e} | {a['mask_mismatches']} | {d} |"
            )
        L.append("")
        for key, sh in rep["shapes"].items():
            if "compiled_ratio_c" in sh:
                L.append(
                    f"* ({key}) ours_compiled (`compiled_rollout_correction`): "
                    f"cpu {sh['ours_compiled']['c']['x_floor']:.1f}x "
                    f"floor ({sh['ours_compiled']['x_floor_pooled_c']:.1f}x pooled floor), "
                    f"{sh['compiled_ratio_c']:.2f}x verl time (median of rounds), "
                    f"{sh['compiled_mem_ratio']:.4f}x verl extra peak RSS; first call (compile) "
                    f"{sh['ours_compiled']['first_call_s']:.1f} s wall."
                )
        for key, sh in rep["shapes"].items():
            a = sh["agree"]
            L.append(
                f"* ({key}): per-round ours/verl ratios, wall "
                f"{', '.join(f'{x:.2f}' for x in sh['ratio_t']['rounds'])}; cpu "
                f"{', '.join(f'{x:.2f}' for x in sh['ratio_c']['rounds'])}. verl RS rejected "
                f"{a['rejected_frac_verl']:.4f} of valid tokens, {a['seq_rejected_frac_verl']:.4f} of rows."
            )
            for k, x, y, rel in a["diffs"]:
                L.append(f"  * `{k}`: ours {x:.9g}, verl {y:.9g} (rel {rel:.1e})")
            if a["only_verl"]:
                L.append(f"  * keys only in verl: {', '.join('`' + k + '`' for k in a['only_verl'])}")
            if a["only_ours"]:
                L.append(
                    f"  * keys only in ours ({len(a['only_ours'])}): "
                    f"{', '.join('`' + k + '`' for k in a['only_ours'])}"
                )
    return "\n".join(L)


BEGIN, END = "<!-- BEGIN bench_correction.py output -->", "<!-- END bench_correction.py output -->"


def write_results(path, md):
    text = open(path).read() if os.path.exists(path) else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    pre, rest = text.split(BEGIN, 1)
    post = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(pre + BEGIN + "\n" + md + "\n" + END + post)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x1024,256x4096")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--mem-reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-dtype", default="float32", choices=["float32", "int64", "int32", "bool"])
    ap.add_argument("--verl-python", default=DEFAULT_VERL_PY)
    ap.add_argument("--no-verl", action="store_true")
    ap.add_argument("--no-ours", action="store_true", help="floor + verl only (before ours exists)")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also time trl_rollout_corr.correction.compiled_rollout_correction (torch.compile; the "
        "compile happens in the warm-up calls and is reported separately)",
    )
    ap.add_argument("--ours-src", default=None, help="import trl_rollout_corr from this checkout (default: repo)")
    ap.add_argument(
        "--ours-rev",
        default=None,
        help="benchmark trl_rollout_corr as committed at this git revision (git archive into a temp dir; "
        "ignores uncommitted edits in the working tree)",
    )
    ap.add_argument("--baseline-rev", default=None,
                    help="also time trl_rollout_corr at this git revision as 'base' (and 'base_compiled'), "
                         "interleaved with ours in the same rounds: a before/after comparison under equal load")
    ap.add_argument("--write-results", default=None, help="replace the generated block in this markdown file")
    ap.add_argument("--json", default=None, help="also save the full report as JSON")
    ap.add_argument("--from-json", default=None, help="only re-render the markdown of a report saved with --json")
    # worker mode
    ap.add_argument("--worker", choices=["ours", "ours_compiled", "verl", "floor"])
    ap.add_argument("--mode", choices=["time", "mem", "dump"], default="time")
    ap.add_argument("--B", type=int)
    ap.add_argument("--T", type=int)
    ap.add_argument("--dump")
    args = ap.parse_args()
    if args.from_json:  # re-render a previous run's report (e.g. after a formatting change)
        with open(args.from_json) as f:
            rep = json.load(f)
        md = to_markdown(rep)
        print(md)
        if args.write_results:
            write_results(args.write_results, md)
        return
    if args.worker:
        res = worker(args)
        print("RESULT " + json.dumps(res), flush=True)
    else:
        driver(args)


if __name__ == "__main__":
    main()
