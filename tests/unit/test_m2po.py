"""M2PO's second-moment mask (correction.m2po): the greedy reference on a constructed batch (ties included), the same
mask from 2 simulated ranks and from micro-batches as from 1 rank on the concatenated batch, metrics, bad input."""

import functools
import math

import pytest
import torch

from trl_rollout_corr.correction.m2po import M2Candidates, m2po_candidates, m2po_mask, m2po_select


def greedy_reference(l_rows, mask_rows, tau):
    """Plain Python: order valid tokens by |l| descending then flat index ascending; mask from the front while the
    mean of l^2 over the remaining valid tokens is above tau. Returns (masked flat positions, before, after)."""
    width = max(len(r) for r in l_rows)
    tokens = [(abs(v), i * width + j, v * v) for i, (r, m) in enumerate(zip(l_rows, mask_rows))
              for j, (v, keep) in enumerate(zip(r, m)) if keep and math.isfinite(v)]
    tokens.sort(key=lambda t: (-t[0], t[1]))
    remaining = [t[2] for t in tokens]
    masked = []

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    before = mean(remaining)
    while remaining and mean(remaining) > tau:
        remaining.pop(0)
        masked.append(tokens[len(masked)][1])
    return masked, before, mean(remaining), width


# a constructed batch: two outliers (1.5, -1.2), a tie at |l| = 0.6 (row 0 col 3 and row 2 col 0), padding, a NaN
L = [[0.1, 1.5, -0.05, 0.6, 0.0],
     [-0.2, 0.3, -1.2, 0.02, 9.0],  # the 9.0 is padding
     [-0.6, 0.25, float("nan"), 0.1, -0.3],
     [0.05, -0.4, 0.15, 0.0, 0.2]]
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def _tensors(dtype=torch.float32):
    return torch.tensor(L, dtype=dtype), torch.tensor(MASK)


@pytest.mark.parametrize("tau", [0.04, 0.08, 0.2, 1.0, 1e-3])
def test_mask_equals_the_greedy_reference(tau):
    l, mask = _tensors(torch.float64)
    keep, sel = m2po_mask(l, mask, tau)
    masked, before, after, width = greedy_reference(L, MASK, tau)
    got = [int(r) * width + int(c) for r, c in zip(sel.masked_row, sel.masked_col)]
    assert got == masked
    expected_keep = [[float(MASK[i][j] and math.isfinite(L[i][j]) and i * width + j not in masked)
                      for j in range(5)] for i in range(4)]
    assert keep.tolist() == expected_keep
    m = sel.metrics()
    assert m["rollout_corr/m2po_second_moment_before"] == pytest.approx(before, rel=1e-12)
    assert m["rollout_corr/m2po_second_moment_after"] == pytest.approx(after, rel=1e-12, abs=1e-300)
    assert m["rollout_corr/m2po_masked_fraction"] == pytest.approx(len(masked) / 18)  # 20 - padding - NaN
    assert m["rollout_corr/m2po_second_moment_after"] <= tau


def test_hand_values_and_the_tie_order():
    l, mask = _tensors(torch.float64)
    # l^2 of the 18 valid tokens by row: 0.01 + 2.25 + 0.0025 + 0.36 + 0 = 2.6225;
    # 0.04 + 0.09 + 1.44 + 0.0004 = 1.5704; 0.36 + 0.0625 + 0.01 + 0.09 = 0.5225;
    # 0.0025 + 0.16 + 0.0225 + 0 + 0.04 = 0.225; total 4.9404
    keep, sel = m2po_mask(l, mask, 0.08)
    assert sel.metrics()["rollout_corr/m2po_second_moment_before"] == pytest.approx(4.9404 / 18)
    # masking 1.5, then -1.2: (4.9404 - 3.69) / 16 = 0.07815 <= 0.08 -> two tokens
    assert [(int(r), int(c)) for r, c in zip(sel.masked_row, sel.masked_col)] == [(0, 1), (1, 2)]
    assert sel.metrics()["rollout_corr/m2po_second_moment_after"] == pytest.approx(1.2504 / 16)
    assert keep[0].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0] and keep[2].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    # at tau = 0.06 one of the tied |l| = 0.6 goes: (1.2504 - 0.36) / 15 = 0.05936 <= 0.06; row 0 col 3 (flat 3)
    # goes before row 2 col 0 (flat 10)
    _, sel = m2po_mask(l, mask, 0.06)
    assert [(int(r), int(c)) for r, c in zip(sel.masked_row, sel.masked_col)] == [(0, 1), (1, 2), (0, 3)]
    # at tau = 0.05 both: (0.8904 - 0.36) / 14 = 0.0379
    _, sel = m2po_mask(l, mask, 0.05)
    assert [(int(r), int(c)) for r, c in zip(sel.masked_row, sel.masked_col)] == [(0, 1), (1, 2), (0, 3), (2, 0)]
    assert sel.metrics()["rollout_corr/m2po_second_moment_after"] == pytest.approx(0.5304 / 14)
    # only tokens with l^2 > tau are ever masked; a loose tau masks nothing
    _, sel = m2po_mask(l, mask, 0.3)
    assert sel.n_masked == 0 and sel.metrics()["rollout_corr/m2po_masked_fraction"] == 0.0


def _random_step(seed, rows=12, width=9):
    g = torch.Generator().manual_seed(seed)
    l = 0.3 * torch.randn(rows, width, generator=g) ** 3  # heavy tails
    l[3, 2] = l[5, 4] = 0.9  # an exact tie across rows
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
    l = torch.where(mask > 0, l, torch.full_like(l, float("nan")))  # padding may hold anything
    return l, mask, lengths


def _trim(l, mask, lengths):
    """A micro-batch padded to its own longest row (different micro-batches have different T)."""
    width = int(lengths.max())
    return l[:, :width], mask[:, :width]


def test_two_ranks_and_micro_batches_give_the_one_rank_mask():
    l, mask, lengths = _random_step(0)
    tau = 0.01
    whole_keep, whole = m2po_mask(l, mask, tau)
    assert 0 < whole.n_masked < int(mask.sum())
    # 2 ranks x 3 micro-batches of 2 rows each, each padded to its own width; rank r holds rows [6 r, 6 r + 6)
    pieces = {}
    for rank in range(2):
        for micro in range(3):
            start = 6 * rank + 2 * micro
            pieces[(rank, micro)] = (start, *_trim(l[start:start + 2], mask[start:start + 2],
                                                   lengths[start:start + 2]))
    per_rank = [M2Candidates.cat([m2po_candidates(pl, pm, s) for (r, _), (s, pl, pm) in pieces.items() if r == rank])
                for rank in range(2)]
    # the all-gather: every rank's block as one (K, 3) tensor, concatenated in rank order (any order works)
    gathered = [M2Candidates.from_tensor(c.to_tensor()) for c in per_rank]
    for order in (gathered, gathered[::-1]):
        sel = m2po_select(M2Candidates.cat(order), tau)
        assert torch.equal(sel.masked_row, whole.masked_row) and torch.equal(sel.masked_col, whole.masked_col)
        assert sel.metrics() == whole.metrics()
        for start, pl, pm in pieces.values():
            width = pl.shape[1]
            assert torch.equal(sel.keep_mask(pm, start, pl), whole_keep[start:start + 2, :width])
    # micro-batch 1 x accumulation 4 (rows 0..3 one at a time) equals micro-batch 4 x accumulation 1
    four = l[:4], mask[:4]
    _, sel4 = m2po_mask(*four, tau)
    ones = M2Candidates.cat([m2po_candidates(*_trim(l[i:i + 1], mask[i:i + 1], lengths[i:i + 1]), i)
                             for i in range(4)])
    sel1 = m2po_select(ones, tau)
    assert torch.equal(sel1.masked_row, sel4.masked_row) and torch.equal(sel1.masked_col, sel4.masked_col)
    assert sel1.metrics() == sel4.metrics()


def test_ties_across_ranks_are_broken_by_global_position():
    l = torch.tensor([[0.9, 0.0], [0.9, 0.0]])
    mask = torch.ones(2, 2)
    # mean l^2 = 0.405; after one: 0.81 / 3 = 0.27; tau 0.3 masks exactly one of the two tied tokens: row 0's
    _, whole = m2po_mask(l, mask, 0.3)
    assert (whole.masked_row.tolist(), whole.masked_col.tolist()) == ([0], [0])
    parts = [m2po_candidates(l[1:], mask[1:], 1), m2po_candidates(l[:1], mask[:1], 0)]  # rank 1 first
    sel = m2po_select(M2Candidates.cat(parts), 0.3)
    assert (sel.masked_row.tolist(), sel.masked_col.tolist()) == ([0], [0])


def test_empty_and_all_masked():
    keep, sel = m2po_mask(torch.zeros(2, 3), torch.zeros(2, 3), 0.04)
    assert sel.n_valid == 0 and keep.sum() == 0 and sel.metrics() == {"rollout_corr/m2po_masked_tokens": 0.0}
    keep, sel = m2po_mask(torch.full((1, 2), 3.0), torch.ones(1, 2), 0.04)  # every token above tau: all masked
    assert keep.tolist() == [[0.0, 0.0]] and "rollout_corr/m2po_second_moment_after" not in sel.metrics()
    assert sel.metrics()["rollout_corr/m2po_masked_fraction"] == 1.0


@pytest.mark.parametrize("tau", [0, -0.04, float("nan"), float("inf")])
def test_bad_threshold(tau):
    with pytest.raises(ValueError, match=r"M2PO threshold tau must be a finite number > 0 .*paper uses 0.04"):
        m2po_mask(torch.zeros(1, 2), torch.ones(1, 2), tau)


def test_bad_positions_and_shapes():
    c = m2po_candidates(torch.ones(1, 2), torch.ones(1, 2), 0)
    with pytest.raises(ValueError, match="repeat a \\(row, column\\) position: each micro-batch and rank must pass"):
        m2po_select(M2Candidates.cat([c, c]), 0.04)
    with pytest.raises(ValueError, match=r"must both be \(B, T\)"):
        m2po_candidates(torch.ones(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="at least one part"):
        M2Candidates.cat([])


# ---------------------------------------------------------------------------------------------- config
def test_config_field():
    from trl_rollout_corr import RolloutCorrectionConfig

    assert RolloutCorrectionConfig(rollout_m2_threshold="0.04").rollout_m2_threshold == 0.04
    cfg = RolloutCorrectionConfig(rollout_m2_threshold=0.04, rollout_is="token", rollout_is_threshold=2.0)
    assert cfg.m2_enabled and cfg.enabled and cfg.to_dict()["rollout_m2_threshold"] == 0.04
    assert not RolloutCorrectionConfig().m2_enabled and RolloutCorrectionConfig().rollout_m2_threshold is None
    for bad in (0, -0.1, "0"):
        with pytest.raises(ValueError, match=r"rollout_m2_threshold must be > 0 .*paper uses 0.04"):
            RolloutCorrectionConfig(rollout_m2_threshold=bad)
    with pytest.raises(TypeError, match="not a boolean"):
        RolloutCorrectionConfig(rollout_m2_threshold=True)
    with pytest.raises(ValueError, match=r"needs decoupled mode: .*Set bypass_mode=False"):
        RolloutCorrectionConfig(rollout_m2_threshold=0.04, bypass_mode=True)


def test_flat_arguments_accept_it_and_analyze_refuses_it(tmp_path):
    from trl_rollout_corr.analyze import ConfigError, yaml_config
    from trl_rollout_corr.config import RolloutCorrectionArguments

    assert RolloutCorrectionArguments(rollout_m2_threshold="0.04").rollout_correction().rollout_m2_threshold == 0.04
    with pytest.raises(ValueError, match="needs decoupled mode"):
        RolloutCorrectionArguments(rollout_corr_preset="bypass_ppo_clip", rollout_m2_threshold="0.04")
    f = tmp_path / "m2.yaml"
    f.write_text("rollout_m2_threshold: 0.04\n")
    with pytest.raises(ConfigError, match=r"rollout_m2_threshold=0.04 \(M2PO\): analyze does not recompute"):
        yaml_config(f)
    assert RolloutCorrectionArguments(rollout_corr_preset="decoupled_k3_rs").rollout_m2_threshold is None


def test_trainer_config_refusals(make_args, tmp_path):
    for bad in (0, -0.04):
        with pytest.raises(ValueError, match=r"rollout_m2_threshold must be > 0"):
            make_args(tmp_path, rollout_m2_threshold=bad)
    with pytest.raises(ValueError, match=r"needs decoupled mode: .*Set bypass_mode=False"):
        make_args(tmp_path, rollout_corr_preset="bypass_pg_is", rollout_m2_threshold=0.04)
    with pytest.raises(ValueError, match=r"steps_per_generation \(4\) must equal gradient_accumulation_steps \(2\)"):
        make_args(tmp_path, rollout_m2_threshold=0.04, gradient_accumulation_steps=2, steps_per_generation=4)
    args = make_args(tmp_path, rollout_m2_threshold=0.04, gradient_accumulation_steps=2)
    assert args.rollout_correction().m2_enabled and args.steps_per_generation == 2


# ---------------------------------------------------------------------------------------------- the step mask
def _reference_keep(l_rows, mask_rows, tau):
    """(keep rows, masked count) from ``greedy_reference`` on rows of possibly different widths."""
    width = max(len(r) for r in l_rows)
    pad = lambda rows, fill: [list(r) + [fill] * (width - len(r)) for r in rows]  # noqa: E731
    l_pad, m_pad = pad(l_rows, 0.0), pad(mask_rows, 0)
    masked, before, after, width = greedy_reference(l_pad, m_pad, tau)
    keep = [[float(m_pad[i][j] > 0 and math.isfinite(l_pad[i][j]) and i * width + j not in masked)
             for j in range(width)] for i in range(len(l_rows))]
    return keep, len(masked), before, after


def test_step_mask_equals_the_greedy_reference_in_any_row_order():
    from trl_rollout_corr.modes.m2po_window import m2po_step_mask

    l, mask = _tensors(torch.float64)
    expected, n_masked, before, after = _reference_keep(L, MASK, 0.05)
    keep, sel = m2po_step_mask(l, mask, 0.05)
    assert keep.tolist() == expected and sel.n_masked == n_masked == 4
    # TRL's shuffled order (pi_old read from the loss forward): rows[i] is the generation row of batch row i
    rows = torch.tensor([2, 0, 3, 1])
    keep, sel = m2po_step_mask(l[rows], mask[rows], 0.05, rows=rows)
    assert keep.tolist() == [expected[r] for r in rows.tolist()] and sel.n_masked == 4
    assert sel.sum_sq_before / sel.n_valid == pytest.approx(before) and sel.sum_sq_after / 14 == pytest.approx(after)


def _rank_worker(rank, world, port, path):
    import torch.distributed as dist

    from trl_rollout_corr.accumulator import Reducers
    from trl_rollout_corr.modes.m2po_window import m2po_step_mask

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    l, mask, lengths = _random_step(0)
    mine = slice(6 * rank, 6 * rank + 6)
    width = int(lengths[mine].max())  # each rank pads to its own longest row
    keep, sel = m2po_step_mask(l[mine, :width].double(), mask[mine, :width], 0.01, Reducers(world, gather=gather),
                               rank)
    torch.save({"keep": keep, "row": sel.masked_row, "col": sel.masked_col, "metrics": sel.metrics()},
               f"{path}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_give_the_one_rank_mask(tmp_path):
    """Two real processes (gloo all-gather of uneven candidate sets, each rank padded to its own width) give the mask
    one rank computes on the concatenated batch."""
    import socket

    import torch.multiprocessing as mp

    from trl_rollout_corr.modes.m2po_window import m2po_step_mask

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, port, str(tmp_path / "out")), nprocs=2, join=True)
    l, mask, _ = _random_step(0)
    whole_keep, whole = m2po_step_mask(l.double(), mask, 0.01)
    assert 0 < whole.n_masked < int(mask.sum())
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert torch.equal(got["row"], whole.masked_row) and torch.equal(got["col"], whole.masked_col)
        assert got["metrics"] == whole.metrics()
        width = got["keep"].shape[1]
        assert torch.equal(got["keep"], whole_keep[6 * rank:6 * rank + 6, :width])


# ---------------------------------------------------------------------------------------------- the trainer
def _train_m2(model_dir, tmp_path, mb, ga, tau):
    """2 steps of M2PO alone (decoupled, no IS/RS) with a bf16 rollout copy (a real mismatch); returns the step logs
    and, per optimizer step, the (l, loss mask, M2 mask) rows of its micro-batches as TRL served them."""
    from conftest import _make_trainer
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            l = (inputs["old_per_token_logps"].double() - inputs["rollout_log_probs"].double())
            seen.append((self.state.global_step, l, inputs["completion_mask"], inputs["rollout_rs_mask"]))
            return loss

    trainer = _make_trainer(model_dir, tmp_path / f"{mb}x{ga}", trainer_cls=Spy, rollout_m2_threshold=tau,
                            rollout_generate_dtype="bfloat16", per_device_train_batch_size=mb,
                            gradient_accumulation_steps=ga, max_steps=2, loss_type="grpo")
    trainer.train()
    steps = {}
    for step, l, m, keep in seen:
        steps.setdefault(step, []).extend(zip(l.tolist(), m.tolist(), keep.tolist()))
    return [h for h in trainer.state.log_history if "loss" in h], steps


@pytest.mark.slow
def test_trainer_mask_is_the_greedy_reference_and_micro_batching_does_not_change_it(llama_dir, tmp_path):
    tau = 2e-5
    runs = {shape: _train_m2(llama_dir, tmp_path, *shape, tau) for shape in ((1, 4), (4, 1))}
    for shape, (logs, steps) in runs.items():
        assert sorted(steps) == [0, 1]
        for step, rows in steps.items():
            assert len(rows) == 4  # one optimizer step: 4 rows, in 4 micro-batches of 1 or 1 of 4
            l_rows = [[v if m else math.nan for v, m in zip(lr, mr)] for lr, mr, _ in rows]
            expected, n_masked, before, after = _reference_keep(l_rows, [mr for _, mr, _ in rows], tau)
            got = [[float(k) for k in keep] + [0.0] * (len(expected[0]) - len(keep)) for _, _, keep in rows]
            assert got == expected, (shape, step)
            log = logs[step]
            n_valid = sum(sum(mr) for _, mr, _ in rows)
            assert log["rollout_corr/m2po_masked_fraction"] == pytest.approx(n_masked / n_valid), (shape, step)
            assert log["rollout_corr/m2po_second_moment_before"] == pytest.approx(before, rel=1e-9)
            assert log["rollout_corr/m2po_second_moment_after"] == pytest.approx(after, rel=1e-9)
            assert log["rollout_corr/m2po_second_moment_after"] <= tau
    fractions = [log["rollout_corr/m2po_masked_fraction"] for log in runs[(4, 1)][0]]
    assert all(0.0 < f < 0.5 for f in fractions), fractions  # the mask acts, on a few outliers
    for small, whole in zip(runs[(1, 4)][0], runs[(4, 1)][0]):
        assert small["rollout_corr/m2po_masked_fraction"] == whole["rollout_corr/m2po_masked_fraction"]
        assert small["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6), small["step"]
        assert small["loss"] == pytest.approx(whole["loss"], rel=1e-6, abs=1e-9), small["step"]


def test_m2po_judges_the_whole_ratio_also_with_rs_on_engine(llama_dir, tmp_path, make_trainer):
    """By design M2PO bounds the second moment of the whole log ratio ``l = log pi_old - log mu`` (staleness
    included: that is its purpose), also when RS judges the engine factor (``rollout_rs_on="engine"``). A constructed
    stale batch where the two differ: engine factor e = 0.01 per token except an engine outlier of 0.9 (row 0, token
    1); rows 2 and 3 are stale by 0.6 nats per token (l = 0.61). tau = 0.1:

    * whole ratio: mean l^2 = (0.81 + 3 x 1e-4 + 6 x 0.3721) / 12 = 0.2536; masking the 0.9 and then k of the six
      0.61 tokens needs (2.2329 - 0.3721 k) / (11 - k) <= 0.1, k >= 4.16: the outlier and 5 stale tokens (ties at
      0.61 in row, then position order);
    * on the engine factor it would mask nothing (mean e^2 = 0.8109 / 12 = 0.0676 <= 0.1).

    The RS band (token_k1 [0.1, 10] on the engine factor) keeps every token, so the trained mask is M2PO's alone."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_rs="token_k1", rollout_rs_threshold="0.1_10",
                           rollout_rs_on="engine", policy_lag_split=True, rollout_m2_threshold=0.1,
                           num_generations=2)
    trainer.model.train()
    mu = torch.full((4, 3), -1.0)
    engine = torch.tensor([[0.0, 0.9, 0.0], [0.01] * 3, [0.01] * 3, [0.01] * 3])
    lag = torch.tensor([[0.0] * 3, [0.0] * 3, [0.6] * 3, [0.6] * 3])
    at_version, old = mu + engine, mu + engine + lag
    batch = dict(completion_mask=torch.ones(4, 3, dtype=torch.long), old_per_token_logps=old,
                 rollout_log_probs=mu, rollout_version_log_probs=at_version,
                 advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]), prompt_ids=torch.ones(4, 1, dtype=torch.long),
                 prompt_mask=torch.ones(4, 1, dtype=torch.long), completion_ids=torch.ones(4, 3, dtype=torch.long))
    from trl_rollout_corr.features.lag_split import LagSplit

    scorer = functools.partial(trainer.rollout_corr_features.get(LagSplit).version_log_probs, trainer)  # as published
    trainer.rollout_corr_mode.apply_correction(trainer, batch, torch.tensor([[1.0], [0.0], [1.0], [0.0]]),
                                               version_log_probs=scorer)  # on GenerationBatch.version_log_probs
    expected = [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert batch["rollout_rs_mask"].tolist() == expected
    l, e = (old.double() - mu.double()), (at_version.double() - mu.double())
    ones = [[1] * 3] * 4
    assert _reference_keep(l.tolist(), ones, 0.1)[0] == expected  # the greedy on the whole ratio
    assert _reference_keep(e.tolist(), ones, 0.1)[0] == [[1.0] * 3] * 4  # the engine factor's: nothing masked
    m = trainer.rollout_corr_metrics.flush("train")
    assert m["rollout_corr/rollout_rs_engine_masked_fraction"] == 0.0  # RS judged the engine factor
    assert m["rollout_corr/m2po_second_moment_before"] == pytest.approx(float((l ** 2).mean()), rel=1e-9)
    assert m["rollout_corr/m2po_second_moment_before"] == pytest.approx(3.0429 / 12, rel=1e-5)
    assert m["rollout_corr/m2po_masked_fraction"] == pytest.approx(6 / 12)
