"""Trained-token-only scoring (``rollout_corr_compact_scoring``, issue 10) changes no number: the same run with
TRL's full scoring and with compact scoring, bit for bit."""

from __future__ import annotations

from unittest import mock


def test_compact_scoring_trains_as_full_scoring_and_projects_only_trained_tokens(llama_dir, tmp_path, make_trainer,
                                                                                step_logs):
    """Same run with TRL's full scoring and with trained-token-only scoring: the same losses, gradient norms and
    metrics bit for bit; the LM head sees one row per trained (completion, non-padding) token."""
    import trl.trainer.utils as trl_utils

    rows = []
    original = trl_utils._ChunkedLogProbFunction.apply

    def spy(hidden, *args):
        rows.append(hidden.size(0))
        return original(hidden, *args)

    runs = {}
    for compact in (False, True):
        rows.clear()
        trainer = make_trainer(llama_dir, tmp_path / str(compact), max_steps=2, rollout_corr_compact_scoring=compact,
                               rollout_corr_preset="decoupled_k3_rs_token_tis", beta=0.04,
                               rollout_corr_old_forward="always")  # keep pi_old's own forward: three forwards
        with mock.patch.object(trl_utils._ChunkedLogProbFunction, "apply", spy):
            trainer.train()
        runs[compact] = ([{k: v for k, v in h.items() if k != "step_time"} for h in step_logs(trainer)], list(rows))
    assert runs[True][0] == runs[False][0]
    full, compact = runs[False][1], runs[True][1]
    # per generation: our pi_old forward, pi_ref (beta > 0) and the loss forward; 4 rows x (prompt + 8 - 1)
    assert len(full) == len(compact) == 6
    assert all(n > c for n, c in zip(full, compact)) and max(compact) <= 4 * 8


def test_compact_scoring_without_a_correction_trains_as_plain_trl(llama_dir, tmp_path, make_args):
    """With no correction configured the trainer (compact scoring on by default) logs plain TRL's losses and gradient
    norms bit for bit, and its LM head sees TRL's rows: compact scoring applies only with a correction (over fewer
    rows the head's matmul can round differently: ``benchmarks/bench_step.py``'s tiny Llama, grad norm 1.9e-6 off
    at step 3)."""
    import trl.trainer.utils as trl_utils
    from trl import GRPOConfig, GRPOTrainer

    from tiny_model import prompt_dataset, reward_len
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    original = trl_utils._ChunkedLogProbFunction.apply
    logs, rows = {}, {}
    for name, cls, config_cls in (("trl", GRPOTrainer, GRPOConfig), ("ours", RolloutCorrGRPOTrainer, None)):
        rows[name] = []

        def spy(hidden, *args, seen=rows[name]):
            seen.append(hidden.size(0))
            return original(hidden, *args)

        args = make_args(tmp_path / name, config_cls=config_cls, max_steps=2, beta=0.04)
        trainer = cls(model=llama_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset(8))
        with mock.patch.object(trl_utils._ChunkedLogProbFunction, "apply", spy):
            trainer.train()
        logs[name] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    assert trainer.args.rollout_corr_compact_scoring and logs["ours"] == logs["trl"]
    assert rows["ours"] == rows["trl"] and len(rows["trl"]) == 4  # pi_ref and the loss forward, 2 steps
