"""Every ``rollout_corr/*`` key reaches the local trackers the recipe configs use (tensorboard, trackio) at the
step it was logged, with the logged value. Two training steps on a tiny random model, in a subprocess (trackio reads
``TRACKIO_DIR`` when it is first imported), with no network: trackio logs locally without a Space."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent('''
    import json, sys
    import torch
    torch.set_num_threads(1)
    from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    tmp = sys.argv[1]
    args = RolloutCorrGRPOConfig(
        output_dir=f"{tmp}/out", report_to=["tensorboard", "trackio"], project="rc-test",
        run_name="tiny", per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2,
        logging_steps=1, use_cpu=True, bf16=False, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True,
        learning_rate=1e-3, rollout_corr_preset="decoupled_k3_rs_token_tis")
    trainer = RolloutCorrGRPOTrainer(model=make_tiny_model_dir(f"{tmp}/model"), reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8))
    trainer.train()
    trainer.end()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import glob
    tb = {}
    for events in glob.glob(f"{tmp}/out/runs/**/events.out.tfevents.*", recursive=True):
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tb.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    from trackio.sqlite_storage import SQLiteStorage
    tracked = [{k: v for k, v in row.items() if isinstance(v, (int, float))}
               for row in SQLiteStorage.get_logs("rc-test", "tiny")]
    steps = [h for h in trainer.state.log_history if "loss" in h]
    print("RESULT " + json.dumps({"steps": steps, "tb": tb, "trackio": tracked}))
''')


def test_rollout_corr_keys_reach_tensorboard_and_trackio(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("trackio")
    tests = Path(__file__).resolve().parents[1] / "helpers"
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1",
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    keys = sorted(k for k in steps[0] if k.startswith("rollout_corr/"))
    # (fewer than the 80-odd of a run whose length slices all hold tokens: an empty slice logs only its num_seqs)
    assert len(keys) > 70 and "rollout_corr/kl" in keys and "rollout_corr/len_0_64/kl" in keys
    # tensorboard (event files in output_dir/runs/): the Trainer writes train/<key>, one scalar per step
    for key in keys:
        points = dict(result["tb"][f"train/{key}"])
        for s in steps:
            assert points[s["step"]] == pytest.approx(s[key], rel=1e-6, abs=1e-12), (key, s["step"])
    # trackio: one row per logged step, keys as logged under train/
    rows = {r["step"]: r for r in result["trackio"] if "train/loss" in r}
    assert sorted(rows) == [1, 2]
    for key in keys:
        for s in steps:
            assert rows[s["step"]][f"train/{key}"] == pytest.approx(s[key], rel=1e-6, abs=1e-12), (key, s["step"])
