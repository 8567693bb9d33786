"""Multi-rank worker for ``tests/e2e/test_distributed.py`` (not collected by pytest).

Recipe (CPU, real DDP over gloo; ``accelerate launch --cpu`` and torchrun without ``use_cpu=True`` give independent
single-process runs instead)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        tests/helpers/dist_worker.py OUT.json MODEL_DIR [deepspeed]

with ``use_cpu=True`` in the ``RolloutCorrGRPOConfig``. Each rank writes ``OUT.json.rank<k>``. With ``deepspeed`` the
trainers get a ZeRO-2 ``deepspeed=`` config (a real ``DeepSpeedEngine`` on 2 CPU ranks; ``pip install deepspeed``).

Part 1 (exact aggregation): a fixed global batch is split unevenly over the ranks (rank 0 holds 10 valid tokens,
rank 1 holds 1000; with one rank, it holds all), every rank runs the correction on its shard (in one call, or in
micro-batches), feeds the trainer's metric accumulator (``trainer.rollout_corr_metrics``: statistics, log ratios and
integer fraction counts) and calls ``trainer.log``:
the logged ``rollout_corr/*`` values must not depend on the number of ranks.
Part 2 (real training): 2 GRPO steps per mode on the tiny model; the logged ``rollout_corr/num_valid_tokens`` must
equal the global completion-token count TRL logs (``completions/mean_length`` times the global batch rows).
Part 3 (advantages across ranks): a run where RS rejects whole rows; each rank reports its rows' rejection flags
and advantages and the gathered rewards, so the test can recompute the group baselines over all ranks by hand.

With ``lag`` as the third argument only the policy-lag run happens: a stale engine (``stale_rollout.StaleRollout``,
sync interval 3) with ``num_iterations=2`` and ``max_policy_lag=2``, 8 rows per step over all ranks; each rank
reports the logged ``rollout_corr/policy_lag_*`` values and the versions of the rows that reached its loss. With
``skip``: ``skip_empty_steps`` on 2 ranks (``skip_run``).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from dist_teardown import run_and_tear_down  # tests/ is on sys.path: this file runs as a script from there
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

CASES = {
    "token_is_bn_rs": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                           rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.8_1.25,0.0055"),
    "seq_is_bn_seqmax": dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
                             rollout_rs="seq_max_k2", rollout_rs_threshold=0.03),
    "icepop_microbatches": dict(rollout_is="token", rollout_is_threshold="0.9_1.1", rollout_rs="seq_sum_k1",
                                rollout_rs_threshold="0.5_2.0"),
}


def global_batch():
    """6 rows: rows 0-1 have 5 valid tokens each (10 in all), rows 2-5 have 250 each (1000 in all)."""
    g = torch.Generator().manual_seed(0)
    width = 250
    lengths = [5, 5, 250, 250, 250, 250]
    log_probs = -2.0 * torch.rand(len(lengths), width, generator=g)
    rollout = log_probs + 0.1 * torch.randn(len(lengths), width, generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rollout[3, 7] = float("nan")  # one invalid token on the big shard
    rollout[0, 100] = float("nan")  # NaN at padding: ignored
    return log_probs, rollout, mask


def shard(world: int, rank: int) -> slice:
    if world == 1:
        return slice(0, 6)
    return slice(0, 2) if rank == 0 else slice(2, 6)


DEEPSPEED_ZERO2 = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}
USE_DEEPSPEED = len(sys.argv) > 3 and sys.argv[3] == "deepspeed"
LAG_ONLY = len(sys.argv) > 3 and sys.argv[3] == "lag"
SKIP_ONLY = len(sys.argv) > 3 and sys.argv[3] == "skip"


def make_args(out_dir: str, **kwargs) -> RolloutCorrGRPOConfig:
    base = dict(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3, beta=0.0, seed=0,
        disable_tqdm=True, bf16=False,
    )
    if USE_DEEPSPEED:
        base["deepspeed"] = DEEPSPEED_ZERO2
    return RolloutCorrGRPOConfig(**{**base, **kwargs})


def lag_run(out_path: str, model_dir: str) -> None:
    """The policy-lag run (see the module docstring); writes ``OUT.json.rank<k>``."""
    from stale_rollout import StaleRollout

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append([self.state.global_step, inputs["rollout_policy_version"].tolist()])
            return super()._compute_loss(model, inputs)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = Spy(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
              rollout_func=StaleRollout(sync_interval=3),
              args=make_args(os.path.join(os.path.dirname(out_path), "lag"), rollout_corr_preset="decoupled_token_is",
                             per_device_train_batch_size=8 // world, num_iterations=2, max_policy_lag=2,
                             max_steps=4))
    run.train()
    logs = [{k: v for k, v in h.items() if k.startswith("rollout_corr/policy_lag")}
            for h in run.state.log_history if "loss" in h]
    with open(f"{out_path}.rank{run.accelerator.process_index}", "w") as f:
        json.dump({"world": run.accelerator.num_processes, "logs": logs, "seen": seen}, f)


def skip_run(out_path: str, model_dir: str) -> None:
    """``skip_empty_steps`` across ranks (issue 44): a stale engine (sync interval 3) with ``max_policy_lag=0``; at
    step 1 rank 1 reports its rows as fresh (kept) while rank 0's are dropped, at step 2 every row is dropped. Each
    rank reports the skipped steps, the logged fraction and a checksum of its weights after every step."""
    from transformers import TrainerCallback

    from stale_rollout import StaleRollout
    from trl_rollout_corr.features import SkipEmptySteps

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

    class RankOneFreshAtStep1(StaleRollout):
        def __call__(self, prompts, trainer):
            out = super().__call__(prompts, trainer)
            step = int(trainer.state.global_step)
            if trainer.accelerator.process_index == 1 and step == 1:
                out["policy_version"] = [step] * len(out["policy_version"])
            return out

    run = RolloutCorrGRPOTrainer(
        model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
        rollout_func=RankOneFreshAtStep1(sync_interval=3),
        args=make_args(os.path.join(os.path.dirname(out_path), "skip"), rollout_corr_preset="decoupled_token_is",
                       max_policy_lag=0, skip_empty_steps=True, max_steps=4))
    sums = []

    class Checksum(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            model = run.accelerator.unwrap_model(run.model)
            sums.append(float(sum(p.detach().double().abs().sum() for p in model.parameters())))

    run.add_callback(Checksum())
    run.train()
    logs = [{k: v for k, v in h.items() if k in ("rollout_corr/skipped_step_fraction",
                                                 "rollout_corr/policy_lag_dropped_fraction")}
            for h in run.state.log_history if "loss" in h]
    with open(f"{out_path}.rank{run.accelerator.process_index}", "w") as f:
        json.dump({"world": run.accelerator.num_processes, "logs": logs, "sums": sums,
                   "skipped": run.rollout_corr_features.get(SkipEmptySteps).skipped}, f)


def main() -> None:
    out_path, model_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if LAG_ONLY:
        lag_run(out_path, model_dir)
        return
    if SKIP_ONLY:
        skip_run(out_path, model_dir)
        return
    work = os.path.dirname(out_path)
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                     args=make_args(os.path.join(work, "exact")))
    world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
    result = {"world": world, "distributed_type": str(trainer.accelerator.distributed_type), "exact": {}, "train": {},
              "engine": {}}

    trainer.model.train()  # log() reads the mode from the model, as during training
    log_probs, rollout, mask = global_batch()
    rows = shard(world, rank)
    metrics, all_reduce = trainer.rollout_corr_metrics, trainer.rollout_corr_reducers.all_reduce
    for name, fields in CASES.items():
        cfg = RolloutCorrectionConfig(**fields)
        lp, mu, m = log_probs[rows], rollout[rows], mask[rows]
        pieces = [slice(None)] if "microbatches" not in name else [slice(i, i + 1) for i in range(lp.size(0))]
        for piece in pieces:
            out = compute_rollout_correction(lp[piece], mu[piece], m[piece], cfg, all_reduce=all_reduce)
            metrics.add_stats("train", out.stats)
            valid = m[piece] != 0
            metrics.add_log_ratios("train", {"engine": (lp[piece] - mu[piece])[valid & torch.isfinite(mu[piece])]})
            # exact fractions from integer counts (routing replay's routing_mismatch_fraction): row r counts r % 3
            # of 4, summed over micro-batches and ranks
            row_ids = torch.arange(6)[rows][piece]
            metrics.add_fraction_counts("train", {"routing_mismatch_fraction": (int((row_ids % 3).sum()),
                                                                                4 * row_ids.numel())})
        trainer.log({})
        logged = trainer.state.log_history[-1]
        result["exact"][name] = {k: v for k, v in logged.items() if k.startswith("rollout_corr/")}

    for preset in ("decoupled_k3_rs_token_tis", "bypass_pg_is"):
        run = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                     args=make_args(os.path.join(work, preset), rollout_corr_preset=preset, top_p=0.9))
        run.train()
        result["engine"][preset] = type(run.model_wrapped).__name__
        logs = [h for h in run.state.log_history if "loss" in h]
        result["train"][preset] = [
            {"loss": h["loss"], "num_valid_tokens": h["rollout_corr/num_valid_tokens"],
             "mean_length": h["completions/mean_length"], "kl": h["rollout_corr/kl"],
             "global_rows": 4 * world}
            for h in logs
        ]
    # Part 3: RS-rejected rows across ranks: every rank's advantages, its rejection flags and the gathered rewards
    seen, gathered_rewards = [], []

    class Spy(RolloutCorrGRPOTrainer):
        def _calculate_rewards(self, *args):
            rewards = super()._calculate_rewards(*args)  # (B_global, F), gathered over the ranks
            gathered_rewards.append(rewards)
            return rewards

        def _compute_loss(self, model, inputs):  # after the loss: pi_old read from it, the correction runs there
            loss = super()._compute_loss(model, inputs)
            rejected = (inputs["completion_mask"].sum(1) > 0) & (inputs["rollout_rs_mask"].sum(1) == 0)
            advantages = inputs["advantages"]
            rows = inputs["rollout_generation_row"]  # TRL shuffled the rows: back to generation order
            in_order = [None] * rows.numel()
            for i, row in enumerate(rows.tolist()):
                in_order[row] = (bool(rejected[i]), float(advantages[i]))
            seen.append({"rewards": gathered_rewards[-1][:, 0].tolist(), "rejected": [r for r, _ in in_order],
                         "advantages": [a for _, a in in_order]})
            return loss

    spy = Spy(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
              args=make_args(os.path.join(work, "rs"), rollout_corr_preset="decoupled_k3_rs",
                             rollout_rs_threshold="0.01", top_p=0.8, max_steps=3))
    spy.train()
    result["rs_rows"] = seen
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_and_tear_down(main)  # the process group destroyed on every rank before it exits
