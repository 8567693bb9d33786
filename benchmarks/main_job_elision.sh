#!/usr/bin/env bash
# The main job's step time with the pi_old forward elided (rollout_corr_old_forward auto, the default) and forced
# (always), issue 21's last Show item: the demo's own command (recipes/grpo_rollout_corr.py with the CPU default
# config, real vLLM CPU rollouts), shortened to --max_steps 4 with no held-out evaluation, run alternately on the same
# machine. Each run holds the shared CPU lock (LOCK, default /tmp/cpu.lock) for itself only and is cut at 480 s.
#
#   benchmarks/main_job_elision.sh [OUT] [MODE ...]     # default: benchmarks/results/main_job_elision auto always
#
# Per run, in OUT: <n>_<mode>_console.txt (the demo's per-step console lines, verbatim, and the start-up line of the
# pi_old plan when the console shows it), <n>_<mode>_steps.json (step_time per step from log.jsonl: TRL's wall
# seconds of training_step, generation included; the process CPU seconds between two logs; the load average
# before and after, the command, the commit). Training outputs (model, log.jsonl) go to /tmp/main_job_elision.
# Needs .venv-vllm (make demo-install) and the converted model (make demo-model); SMOLLM2 overrides the model path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results/main_job_elision}"
shift || true
MODES=("$@")
[ ${#MODES[@]} -eq 0 ] && MODES=(auto always)
PY="${VLLM_PY:-$ROOT/.venv-vllm/bin/python}"
[ -x "$PY" ] || PY=/work/main/.venv-vllm/bin/python
SMOLLM2="${SMOLLM2:-$ROOT/models/SmolLM2-135M-Instruct}"
[ -d "$SMOLLM2" ] || SMOLLM2=/work/main/models/SmolLM2-135M-Instruct
LOCK="${LOCK:-/tmp/cpu.lock}"
STEPS="${STEPS:-4}"
mkdir -p "$OUT"
n=$(ls "$OUT" | grep -c '_steps.json$' || true)
cd "$ROOT"
for mode in "${MODES[@]}"; do
  case "$mode" in auto|always) ;; *) echo "mode must be auto or always, not '$mode'" >&2; exit 2 ;; esac
  n=$((n + 1))
  tag="${n}_${mode}"
  run_dir="/tmp/main_job_elision/$tag"
  rm -rf "$run_dir"; mkdir -p "$(dirname "$run_dir")"
  cmd=("$PY" recipes/grpo_rollout_corr.py --config recipes/configs/cpu_smollm2_decoupled.yaml
       --model_name_or_path "$SMOLLM2" --output_dir "$run_dir" --torch_threads 1 --max_steps "$STEPS"
       --eval_size 0 --report_to none --no_plots --rollout_corr_old_forward "$mode")
  commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- trl_rollout_corr recipes || echo '+changes')"
  load_before="$(cat /proc/loadavg)"
  started="$(date -u +%FT%TZ)"
  t0=$(date +%s)
  rc=0
  OMP_NUM_THREADS=1 PYTHONPATH="$ROOT" flock "$LOCK" timeout 480 "${cmd[@]}" > "$run_dir.console.log" 2>&1 || rc=$?
  wall=$(( $(date +%s) - t0 ))
  load_after="$(cat /proc/loadavg)"
  grep -E '^step [0-9]+/|pi_old|old_forward' "$run_dir.console.log" > "$OUT/${tag}_console.txt" || true
  "$PY" - "$run_dir/log.jsonl" "$OUT/${tag}_steps.json" "$mode" "$rc" "$wall" "$load_before" "$load_after" \
      "$started" "$commit" "${cmd[*]}" <<'EOF'
import json, sys
log, out, mode, rc, wall, before, after, started, commit, command = sys.argv[1:]
steps, cpu_prev = [], 0.0
try:
    for line in open(log):
        rec = json.loads(line)
        if "step_time" in rec and "loss" in rec:  # cpu_s: this process's CPU s (all threads) since the last log
            steps.append({"step": rec.get("step"), "step_time_s": rec["step_time"], "loss": rec["loss"],
                          "cpu_s_since_last_log": round(rec["cpu_time"] - cpu_prev, 3),
                          "logged": {k: v for k, v in rec.items() if isinstance(v, (int, float))}})
            cpu_prev = rec["cpu_time"]
except FileNotFoundError:
    pass
json.dump({"mode": mode, "rc": int(rc), "wall_s": int(wall), "loadavg_before": before, "loadavg_after": after,
           "started": started, "commit": commit, "command": command, "steps": steps}, open(out, "w"), indent=1)
print(mode, "rc", rc, "wall", wall, "s;", " ".join(f"{s['step_time_s']:.1f}" for s in steps), "| load", before)
EOF
done
"$PY" "$ROOT/benchmarks/main_job_elision_summary.py" "$OUT"
