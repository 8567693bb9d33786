"""The one per-token mask pipeline (issue 48, ``correction.mask_pipeline``): each step and a composed chain by hand,
the modes' chains, and the bypass loss and its batch-normalisation window handing the correction the same tokens
through the same chain (they were two copies before)."""

from __future__ import annotations

import math

import pytest
import torch

from stale_rollout import StaleRollout
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.correction import make_correction_fn
from trl_rollout_corr.correction.mask_pipeline import (
    MaskContext,
    MaskPipeline,
    chain,
    correction,
    lag_rows,
    m2po,
)
from trl_rollout_corr.lag import stale_row_keep

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])  # int64, as TRL's completion_mask
NAN = float("nan")
# l = log pi_old - log mu: row 0 ratios e^[0, .5, -.5] = [1, 1.65, .61]; row 1 e^[0, .2, 1] = [1, 1.22, 2.72], NaN
L = torch.tensor([[0.0, 0.5, -0.5, 0.0], [0.0, 0.2, 1.0, NAN], [0.0, 0.1, 0.0, 0.0]], dtype=torch.float64)
ROLLOUT = torch.full((3, 4), -1.0)
OLD = (ROLLOUT.double() + L).float()
RS = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5")  # keeps ratios in [0.5, 1.5]


# ---------------------------------------------------------------------------------------------- each step
def test_lag_rows_by_hand():
    keep = torch.tensor([True, False, True])
    out = lag_rows(MASK, MaskContext(row_keep=keep))
    assert out.dtype == torch.int64 and out.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    as_float = lag_rows(MASK.float(), MaskContext(row_keep=keep))
    assert as_float.dtype == torch.float32 and as_float.tolist() == out.tolist()
    assert lag_rows(MASK, MaskContext()) is MASK  # no row rule: the mask itself
    with pytest.raises(ValueError, match=r"row_keep must be \(B,\) = \(3,\)"):
        lag_rows(MASK, MaskContext(row_keep=torch.tensor([True, False])))
    with pytest.raises(ValueError, match=r"must be a \(B, T\) tensor"):
        lag_rows(MASK[0], MaskContext(row_keep=keep))


def test_stale_row_keep_is_max_policy_lag_rule():
    versions = torch.tensor([3, 1, 2])
    assert stale_row_keep(versions, 3, 1).tolist() == [True, False, True]  # lags 0, 2, 1
    assert stale_row_keep(versions, 3, None) is None and stale_row_keep(None, 3, 0) is None


def test_correction_step_is_the_rs_and_invalid_mask():
    fn = make_correction_fn(RS)
    seen = []

    def correct(mask):
        seen.append(mask)
        return fn(OLD, ROLLOUT, mask).response_mask

    out = correction(MASK, MaskContext(correct=correct))
    # row 0: keep, reject (1.65), keep (.61), pad; row 1: keep, keep (1.22), reject (2.72), invalid (NaN);
    # row 2: ratios 1, 1.11 kept
    assert out.dtype == torch.int64 and out.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert seen[0] is MASK
    with pytest.raises(ValueError, match="needs MaskContext.correct"):
        correction(MASK, MaskContext())
    with pytest.raises(ValueError, match="must keep the input's shape and dtype"):
        correction(MASK, MaskContext(correct=lambda m: m.float()))


def test_m2po_step_by_hand():
    keep = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    out = m2po(MASK, MaskContext(m2po_keep=lambda m: keep))
    assert out.dtype == torch.int64 and out.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match="needs MaskContext.m2po_keep"):
        m2po(MASK, MaskContext())
    with pytest.raises(ValueError, match="keep mask is"):
        m2po(MASK, MaskContext(m2po_keep=lambda m: keep[:2]))


def test_chain_order_and_identity():
    calls = []

    def first(mask, ctx):
        calls.append("first")
        return mask * 2

    def second(mask, ctx):
        calls.append("second")
        return mask + 1

    assert chain(first, second)(MASK, MaskContext()).tolist() == ((MASK * 2) + 1).tolist()
    assert calls == ["first", "second"]
    assert chain()(MASK, MaskContext()) is MASK
    with pytest.raises(TypeError, match="every step must be a callable"):
        chain(lag_rows, "m2po")


def test_pipeline_rows_stop_before_the_correction():
    pipeline = MaskPipeline(lag_rows, correction, m2po)
    assert pipeline.steps == (lag_rows, correction, m2po) and pipeline.rows.steps == (lag_rows,)
    assert MaskPipeline(lag_rows).rows.steps == (lag_rows,)  # no correction: every step is a row step
    assert repr(pipeline) == "MaskPipeline(lag_rows, correction, m2po)"
    with pytest.raises(ValueError, match="correction step may appear once"):
        MaskPipeline(correction, lag_rows, correction)


# ---------------------------------------------------------------------------------------------- a composed chain
def test_decoupled_chain_by_hand():
    """Decoupled scoring's chain on a hand batch, with the real correction and the real M2PO mask: lag rows, then
    RS + invalid, then M2PO over what is left."""
    from trl_rollout_corr.modes.m2po_window import m2po_step_mask

    fn = make_correction_fn(RS)
    seen = {}

    def correct(mask):
        seen["correction"] = mask
        return fn(OLD, ROLLOUT, mask).response_mask

    def m2po_keep(mask):
        seen["m2po"] = mask
        return m2po_step_mask(OLD.double() - ROLLOUT.double(), mask, 0.05)[0]

    ctx = MaskContext(row_keep=torch.tensor([True, True, False]), correct=correct, m2po_keep=m2po_keep)
    out = MaskPipeline(lag_rows, correction, m2po)(MASK, ctx)
    assert seen["correction"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]  # row 2 stale: out first
    assert seen["m2po"].tolist() == [[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]  # RS + the NaN token out
    # M2PO over l = [0, -.5 | 0, .2]: mean l^2 = .29 / 4 = .0725 > .05; masking |l| = .5 leaves .04 / 3 <= .05
    assert out.dtype == torch.int64 and out.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------- the modes' chains
class _HalfFresher(StaleRollout):
    """Every even row reports one version newer than it is (never ahead of the trainer): at a step where the engine
    is 2 steps stale, ``max_policy_lag=1`` keeps half the rows and drops the other half."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        step = int(trainer.state.global_step)
        out["policy_version"] = [v + 1 if i % 2 == 0 and v + 1 <= step else v
                                 for i, v in enumerate(out["policy_version"])]
        return out


def test_bypass_loss_and_window_run_the_same_chain(llama_dir, tmp_path, monkeypatch):
    """Bypass + batch normalisation + accumulation 2 + ``max_policy_lag=1`` with a stale engine (lag 2 at step 2,
    half the rows dropped): the mask the window hands the correction for a step is, bit for bit, the concatenation
    of the masks the step's two loss calls hand it, and every one of them is an output of the mode's one chain."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=8, max_steps=3, logging_steps=1,
        report_to=[], use_cpu=True, learning_rate=1e-3, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True,
        bf16=False, rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True, max_policy_lag=1,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, loss_type="grpo")
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8), rollout_func=_HalfFresher(sync_interval=3))
    mode = trainer.rollout_corr_mode
    assert mode.masks.steps == (lag_rows, correction) and mode.masks.rows.steps == (lag_rows,)
    made, rows_chain = [], mode.masks.rows

    def rows_spy(mask, ctx):
        out = rows_chain(mask, ctx)
        made.append(out)
        return out

    mode.masks.rows = rows_spy
    windows, losses, fn = [], [], mode.correction_fn

    def spy(log_probs, rollout_log_probs, mask, all_reduce=None):
        if log_probs.size(0) == 8:  # the window: the step's micro-batches, each through the chain, concatenated
            windows.append(mask.clone())
        else:
            assert any(mask is m for m in made), "a loss mask reached the correction without the mode's chain"
            losses.append(mask.clone())
        return fn(log_probs, rollout_log_probs, mask, all_reduce=all_reduce)

    mode.correction_fn = spy
    trainer.train()
    assert len(windows) == 3 and len(losses) == 6
    dropped = 0
    for step, window in enumerate(windows):
        together = torch.cat(losses[2 * step: 2 * step + 2])
        assert window.dtype == together.dtype and torch.equal(window, together), step
        dropped += int((window.sum(dim=1) == 0).sum())
    assert len(made) == 3 * 2 + 6  # each window's 2 micro-batches, each loss call
    assert dropped > 0  # the lag filter acted (step 2: the rows at lag 2), in the window as in the loss
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[2]["rollout_corr/policy_lag_dropped_fraction"] == pytest.approx(0.5)
    assert all(math.isfinite(h["loss"]) for h in logs)


def test_decoupled_chain_composed_once_with_m2po(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", max_steps=1)
    assert trainer.rollout_corr_mode.masks.steps == (lag_rows, correction)
    trainer = make_trainer(llama_dir, tmp_path / "m2", rollout_corr_preset="decoupled_token_is",
                           rollout_m2_threshold=0.04, max_steps=1)
    assert trainer.rollout_corr_mode.masks.steps == (lag_rows, correction, m2po)
