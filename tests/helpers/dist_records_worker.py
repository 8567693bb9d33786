"""Multi-rank worker for ``tests/features/test_analyze.py::test_two_rank_dump_is_reproduced`` (not collected by
pytest).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        tests/helpers/dist_records_worker.py DUMP MODEL_DIR

Trains 2 GRPO steps with real gloo DDP on CPU (``use_cpu=True``) with rollout records on, in decoupled mode with
batch-normalised token IS and RS, so that the recomputation must merge both ranks' rows of each generation batch
(the batch-normalisation mean is global) and each rank's step file. Writes ``DUMP.rank<k>.json`` with the
world size and this rank's writer counts.
"""

from __future__ import annotations

import json
import sys

import torch

from dist_teardown import run_and_tear_down  # tests/ is on sys.path: this file runs as a script from there
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer


def main() -> None:
    dump, model_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    args = RolloutCorrGRPOConfig(
        output_dir=dump + ".out", use_cpu=True, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=2, logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3,
        beta=0.0, seed=0, disable_tqdm=True, bf16=False, top_p=0.9, rollout_dump_dir=dump,
        rollout_is="token", rollout_is_threshold="2.0", rollout_is_batch_normalize=True, rollout_rs="seq_mean_k3",
        rollout_rs_threshold="0.05",
    )
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                     args=args)
    trainer.train()
    writer = trainer.rollout_records
    with open(f"{dump}.rank{trainer.accelerator.process_index}.json", "w") as f:
        json.dump({"world": trainer.accelerator.num_processes, "rows": writer.rows_written}, f)


if __name__ == "__main__":
    run_and_tear_down(main)  # the process group destroyed on every rank before it exits
