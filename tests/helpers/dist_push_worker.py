"""Multi-rank worker for ``tests/features/test_resume_features.py``'s two-rank push test (not collected by pytest).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_push_worker.py OUT MODEL

Trains 2 GRPO steps with real gloo DDP on CPU with ``push_to_hub=True``, ``hub_strategy="checkpoint"`` and a
checkpoint every step, against a fake Hub (``HfApi.create_repo`` / ``upload_folder`` replaced; the test sets
``HF_ENDPOINT`` to a closed local port, so any other Hub call fails). Rank 1 writes its features' state file 2 s
late, so an upload that did not wait for every rank would miss it. Writes ``OUT/result.rank<k>.json``: the world
size, the uploads this rank made (each with the features' state files in the uploaded folder and the step inside
each, read at upload time) and the checkpoint folders this rank wrote its file into.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from dist_teardown import run_and_tear_down  # tests/helpers/ is on sys.path: this file runs as a script from there
from tiny_model import prompt_dataset, reward_len

UPLOADS: list[dict] = []
WRITES: list[str] = []


def fake_create_repo(repo_id, **kwargs):
    from huggingface_hub import RepoUrl

    return RepoUrl(f"http://127.0.0.1:9/{repo_id}", endpoint="http://127.0.0.1:9")


def fake_upload_folder(*, repo_id, folder_path, commit_message=None, run_as_future=False, **kwargs):
    root = Path(folder_path)
    files = sorted(p.name for p in root.glob("rollout_corr_features.rank-*.pt"))
    UPLOADS.append({"path_in_repo": kwargs.get("path_in_repo"), "message": commit_message, "files": files,
                    "steps": [torch.load(root / f, weights_only=False)["global_step"] for f in files]})
    done = Future()
    done.set_result(None)
    return done


def main() -> None:
    out, model_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    from huggingface_hub import HfApi

    from trl_rollout_corr import checkpoint_state
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    HfApi.create_repo = staticmethod(fake_create_repo)
    HfApi.upload_folder = staticmethod(fake_upload_folder)
    real_save = checkpoint_state.save

    def late_save(trainer, folder):
        if trainer.accelerator.process_index == 1:
            time.sleep(2.0)
        WRITES.append(Path(folder).name)
        return real_save(trainer, folder)

    checkpoint_state.save = late_save
    args = RolloutCorrGRPOConfig(
        output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to=[], save_strategy="steps", save_steps=1, learning_rate=1e-3,
        beta=0.0, seed=0, disable_tqdm=True, bf16=False, push_to_hub=True, hub_model_id="someone/tiny-rc",
        hub_strategy="checkpoint", hub_always_push=True, rollout_dump_dir=os.path.join(out, "dump"),
    )
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                     args=args)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
        json.dump({"world": trainer.accelerator.num_processes, "uploads": UPLOADS, "writes": WRITES}, f)


if __name__ == "__main__":
    run_and_tear_down(main)  # the process group destroyed on every rank before it exits
