#!/usr/bin/env bash
# Issue 22: the main job with rollout records and features that are not R3 (the CPU default preset, decoupled
# token TIS + seq_mean_k3 RS, plus policy_lag_split, rollout_sync_interval 2 (stale rollouts, lag 0/1) and
# max_policy_lag 1), interrupted once after its step-2 checkpoint, resumed from checkpoint-2 into the same
# rollout_dump_dir up to step 4, then `trl-rollout-corr analyze` on the dump.
#
#   run 1: --max_steps 4 --save_steps 2, killed (SIGTERM to its process group) once checkpoint-2 is saved and the
#          step-3 Parquet file is written (so the resumed run has a window to move to superseded/resume-at-2/);
#   run 2: the same command + --resume_from_checkpoint OUT/checkpoint-2, steps 3-4;
#   analyze: the check (every logged rollout_corr/* value recomputed to 1e-5 x max(1, |value|), exit 1 if not);
#   dump_check.json: run id, logged steps, step files, rows per step, superseded files, resumed_at_step.
#
# Usage (about 10 min on the shared 2-core machine; one core, --torch_threads 1):
#   PY=/work/main/.venv-vllm/bin/python MODEL=/work/main/models/SmolLM2-135M-Instruct \
#       flock /tmp/cpu.lock bash benchmarks/records_resume_main_job.sh
# Checkpoints and weights stay in RUN (default /tmp/records_resume_run, removed first); the small outputs go to
# RESULT (default benchmarks/results/records_resume).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv-vllm/bin/python}
MODEL=${MODEL:-$ROOT/models/SmolLM2-135M-Instruct}
RUN=${RUN:-/tmp/records_resume_run}
RESULT=${RESULT:-$ROOT/benchmarks/results/records_resume}
export PYTHONPATH=$ROOT OMP_NUM_THREADS=1 TRL_ROLLOUT_CORR_SMOLLM2=$MODEL
cd "$ROOT"
rm -rf "$RUN" && mkdir -p "$RUN" "$RESULT"
OUTDIR=$RUN/out
DUMP=$RUN/rollouts
ARGS=(recipes/grpo_rollout_corr.py --config recipes/configs/cpu_smollm2_decoupled.yaml
      --model_name_or_path "$MODEL" --output_dir "$OUTDIR" --torch_threads 1
      --max_steps 4 --eval_size 0 --save_strategy steps --save_steps 2 --report_to none --no_plots
      --policy_lag_split true --rollout_sync_interval 2 --max_policy_lag 1
      --rollout_dump_dir "$DUMP")
echo "command: $PY ${ARGS[*]}" | tee "$RESULT/commands.txt"
t0=$(date +%s)

# run 1: interrupted after checkpoint-2 (once step 3's records are on disk)
setsid "$PY" "${ARGS[@]}" >"$RUN/run1.log" 2>&1 &
pid=$!
stop_reason="timeout (1500 s)"
for _ in $(seq 750); do
    if ! kill -0 "$pid" 2>/dev/null; then stop_reason="exited by itself"; break; fi
    if [[ -f $OUTDIR/checkpoint-2/trainer_state.json && -n $(compgen -G "$DUMP/steps/step-00000003.*") ]]; then
        sleep 2; stop_reason="killed after checkpoint-2 and step 3's records"; break
    fi
    sleep 2
done
kill -TERM -- "-$pid" 2>/dev/null || true
for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
kill -KILL -- "-$pid" 2>/dev/null || true
wait "$pid" || true
t1=$(date +%s)
echo "run 1: $stop_reason, $((t1 - t0)) s" | tee -a "$RESULT/commands.txt"
cp "$OUTDIR/log.jsonl" "$RUN/run1_log.jsonl" 2>/dev/null || true
ls "$DUMP/steps" >"$RUN/run1_step_files.txt"
test -f "$OUTDIR/checkpoint-2/trainer_state.json"

# run 2: resumed from checkpoint-2, same dump folder, to step 4
echo "resume: $PY ${ARGS[*]} --resume_from_checkpoint $OUTDIR/checkpoint-2" | tee -a "$RESULT/commands.txt"
set +e
"$PY" "${ARGS[@]}" --resume_from_checkpoint "$OUTDIR/checkpoint-2" >"$RUN/run2.log" 2>&1
rc2=$?
t2=$(date +%s)
echo "run 2: exit $rc2, $((t2 - t1)) s" | tee -a "$RESULT/commands.txt"
cp "$OUTDIR/log.jsonl" "$RUN/run2_log.jsonl" 2>/dev/null

# analyze (the check only; exit 1 = a logged value not reproduced)
"$PY" -m trl_rollout_corr.cli analyze "$DUMP" --out "$RUN/analysis" --no-plots >"$RESULT/analyze.txt" 2>&1
rc=$?
t3=$(date +%s)
echo "analyze: exit $rc, $((t3 - t2)) s; total $((t3 - t0)) s" | tee -a "$RESULT/commands.txt"

# small outputs only (no weights, no checkpoints)
cp "$RUN/analysis/analysis.json" "$RUN/run1_step_files.txt" "$RESULT/"
rm -rf "$RESULT/rollouts" && cp -r "$DUMP" "$RESULT/rollouts"   # the dump itself: about 150 kB
for n in 1 2; do tail -n 40 "$RUN/run$n.log" >"$RESULT/run${n}_log_tail.txt"; done
(cd "$DUMP" && find . -type f -printf '%s %p\n' | sort -k2) >"$RESULT/dump_files.txt"

"$PY" - "$DUMP" "$RESULT/dump_check.json" <<'EOF'
import json
import sys
from collections import Counter
from pathlib import Path

from trl_rollout_corr.records import open_dump

dump_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
dump = open_dump(dump_dir)
table = dump.read_table()
lines = [json.loads(x) for x in (dump_dir / "logs.jsonl").read_text().splitlines() if x.strip()]
logged = [w.logged_step for w in dump.windows]
report = {
    "run_id": dump.metadata.get("run_id"),
    "logged_steps": logged,
    "each_step_once": logged == sorted(set(logged)),
    "logs_jsonl_steps": [x["logged_step"] for x in lines],
    "resumed_at_step": [x.get("resumed_at_step") for x in lines],
    "step_files": sorted(p.name for p in (dump_dir / "steps").iterdir()),
    "rows_per_logged_step": dict(sorted(Counter(table.column("logged_step").to_pylist()).items())),
    "generation_batches": sorted(set(table.column("generation_batch").to_pylist())),
    # (logged_step, step at use, generation_step, policy_version): rows
    "versions": {str(k): n for k, n in sorted(Counter(zip(*(table.column(c).to_pylist() for c in (
        "logged_step", "step", "generation_step", "policy_version")))).items())},
    "superseded": sorted(str(p.relative_to(dump_dir)) for p in (dump_dir / "superseded").rglob("*") if p.is_file()),
}
out.write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
EOF

# step 3 of the interrupted run (moved to superseded/) against step 3 of the resumed run
"$PY" - "$DUMP" "$RESULT/resume_step3_compare.json" <<'EOF'
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

dump_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
aside = dump_dir / "superseded" / "resume-at-00000002"
before = pq.read_table(aside / "step-00000003.rank-00000.parquet")
after = pq.read_table(dump_dir / "steps" / "step-00000003.rank-00000.parquet")
old = json.loads((aside / "logs.jsonl").read_text().splitlines()[0])["metrics"]
new = next(json.loads(x) for x in (dump_dir / "logs.jsonl").read_text().splitlines()
           if json.loads(x)["logged_step"] == 3)["metrics"]
report = {
    "columns_compared": len(before.column_names),
    "columns_differing": [c for c in before.column_names
                          if before.column(c).to_pylist() != after.column(c).to_pylist()],
    "logged_values_compared": len(set(old) & set(new)),
    "logged_values_differing": {k: [old[k], new[k]] for k in sorted(set(old) & set(new)) if old[k] != new[k]},
    "keys_only_in_one": sorted(set(old) ^ set(new)),
}
out.write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
EOF
exit $(( rc2 ? rc2 : rc ))
