"""The ordering rules between the trainer's features (``hooks.py``, rules 1-4; ``docs/explanation/architecture.md``),
in code:
the one ``FEATURES`` tuple, the container's nesting, and the interactions that depend on the order, seen in real
training runs on tiny models."""

from __future__ import annotations

import contextlib

import pytest

from trl_rollout_corr.features import (
    FEATURES,
    BehaviourLogProbs,
    LagSplit,
    PolicyLag,
    RolloutRecords,
    RoutingReplay,
    SkipEmptySteps,
    SupportMatching,
)
from trl_rollout_corr.hooks import AFTER_HOOKS, AROUND_HOOKS, BEFORE_HOOKS, Feature, Features


# ---------------------------------------------------------------------------------------------- the rules
@pytest.mark.unit
def test_the_one_feature_order():
    """Behaviour first (mu exists before anything reads it; its generate capture encloses routing's recorder),
    policy lag before the mode scores, routing before support (replay encloses support scoring), records last
    (nothing is written before every other part accepted the setup)."""
    assert FEATURES == (BehaviourLogProbs, PolicyLag, RoutingReplay, SupportMatching, LagSplit, SkipEmptySteps,
                        RolloutRecords)
    assert len(set(FEATURES)) == len(FEATURES) and all(issubclass(f, Feature) for f in FEATURES)


class _Traced(Feature):
    """A feature that logs the hooks it sees as (its tag, hook, event)."""

    def __init__(self, tag, log):
        self.tag, self.log = tag, log

    @contextlib.contextmanager
    def forward(self, trainer, call):
        self.log.append((self.tag, "forward", "enter"))
        yield
        self.log.append((self.tag, "forward", "exit"))

    def on_batch(self, trainer, gen, batch):
        self.log.append((self.tag, "on_batch", "call"))

    def after_loss(self, trainer, step):
        self.log.append((self.tag, "after_loss", "call"))


@pytest.mark.unit
def test_around_nests_in_order_before_runs_in_order_after_in_reverse():
    log: list = []
    container = Features([_Traced(tag, log) for tag in "abc"])
    with container.around("forward", None, None):
        log.append(("body", "forward", "call"))
    container.before("on_batch", None, None, None)
    container.after("after_loss", None, None)
    assert log == [("a", "forward", "enter"), ("b", "forward", "enter"), ("c", "forward", "enter"),
                   ("body", "forward", "call"),
                   ("c", "forward", "exit"), ("b", "forward", "exit"), ("a", "forward", "exit"),
                   ("a", "on_batch", "call"), ("b", "on_batch", "call"), ("c", "on_batch", "call"),
                   ("c", "after_loss", "call"), ("b", "after_loss", "call"), ("a", "after_loss", "call")]
    assert set(AROUND_HOOKS) | set(BEFORE_HOOKS) | set(AFTER_HOOKS) <= set(vars(Feature))


@pytest.mark.unit
def test_a_feature_that_does_not_override_a_hook_is_not_called():
    called = []

    class OnlyOnBatch(Feature):
        def on_batch(self, trainer, gen, batch):
            called.append("on_batch")

    container = Features([OnlyOnBatch(None), Feature(None)])
    assert container._implementers("forward") == [] and len(container._implementers("on_batch")) == 1
    container.before("on_batch", None, None, None)
    with container.around("forward", None, None):
        pass
    assert called == ["on_batch"]
    assert container.get(OnlyOnBatch) is container.items[0] and container.get(RoutingReplay) is None
    with pytest.raises(AssertionError):
        container.before("after_loss")  # an after hook called as a before hook: a dispatcher bug


def test_features_present_follow_the_config(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, max_steps=1)
    assert [type(f) for f in trainer.rollout_corr_features] == [BehaviourLogProbs, PolicyLag, SupportMatching]
    assert trainer.rollout_corr_mode.name == "diagnostics"
    trainer = make_trainer(llama_dir, tmp_path / "b", rollout_corr_preset="decoupled_token_is", policy_lag_split=True,
                           rollout_dump_dir=str(tmp_path / "dump"))
    assert [type(f) for f in trainer.rollout_corr_features] == [BehaviourLogProbs, PolicyLag, SupportMatching,
                                                                 LagSplit, RolloutRecords]
    assert trainer.rollout_corr_mode.name == "decoupled" and trainer.rollout_records is not None


# ---------------------------------------------------------------------------------------------- the interactions
def _trace_forward_hooks(monkeypatch, classes, log):
    """Wrap ``forward`` of each class so that every forward logs (class name, role, enter / exit)."""
    for cls in classes:
        original = cls.forward

        @contextlib.contextmanager
        def forward(self, trainer, call, _original=original, _name=cls.__name__):
            with _original(self, trainer, call):
                log.append((_name, call.role, "enter"))
                yield
                log.append((_name, call.role, "exit"))

        monkeypatch.setattr(cls, "forward", forward)


def test_routing_replay_encloses_support_scoring(qwen3_moe_dir, tmp_path, make_trainer, monkeypatch):
    """Routing before support in FEATURES: in every forward both act on, the replay is open while the support
    scorer runs (decoupled + recompute + r3: TRL's pi_old forward is replaced, ours is ``old``)."""
    log: list = []
    _trace_forward_hooks(monkeypatch, (RoutingReplay, SupportMatching), log)
    trainer = make_trainer(qwen3_moe_dir, tmp_path, rollout_corr_preset="decoupled_token_is", top_p=0.8,
                           rollout_support_matching="recompute", routing_replay="r3", max_steps=1,
                           rollout_corr_old_forward="always")  # pi_old's own forward, then the loss forward
    trainer.train()
    old = [entry for entry in log if entry[1] == "old"]
    assert old == [("RoutingReplay", "old", "enter"), ("SupportMatching", "old", "enter"),
                   ("SupportMatching", "old", "exit"), ("RoutingReplay", "old", "exit")]
    assert [e for e in log if e[1] == "loss"][:2] == [("RoutingReplay", "loss", "enter"),
                                                      ("SupportMatching", "loss", "enter")]


def test_batch_norm_window_forwards_never_nest_in_the_loss_replay(qwen3_moe_dir, tmp_path, make_trainer,
                                                                  monkeypatch):
    """Bypass + batch normalisation + accumulation + r3: the window's forwards (one per micro-batch of the step, at
    its first micro-batch) each open and close their own replay before the loss forward opens its one (replay blocks
    do not nest)."""
    log: list = []
    _trace_forward_hooks(monkeypatch, (RoutingReplay,), log)
    trainer = make_trainer(qwen3_moe_dir, tmp_path, rollout_corr_preset="bypass_ppo_clip", rollout_is="token",
                           rollout_is_batch_normalize=True, gradient_accumulation_steps=2, routing_replay="r3",
                           max_steps=1)
    trainer.train()
    depth, deepest = 0, 0
    for _, _, event in log:
        depth += 1 if event == "enter" else -1
        deepest = max(deepest, depth)
    assert deepest == 1 and depth == 0
    roles = [role for _, role, event in log if event == "enter"]
    assert roles == ["batch_norm_window", "batch_norm_window", "bypass_loss", "bypass_loss"]


def test_records_see_the_micro_batch_as_trl_passed_it(llama_dir, tmp_path, make_trainer, monkeypatch):
    """Records after_loss reads ``LossStep.original``: with ``max_policy_lag`` dropping stale rows (bypass: through
    a ``tool_mask`` on a copy of the inputs) the records still store TRL's micro-batch (no ``tool_mask``), while the
    loss trained on the filtered copy."""
    from trl_rollout_corr import records

    recorded, trained = [], []
    add = records.RolloutRecordWriter.add
    monkeypatch.setattr(records.RolloutRecordWriter, "add",
                        lambda self, batch: (recorded.append(batch.per_token["tool_mask"]), add(self, batch)))
    original_before_loss = PolicyLag.before_loss

    def before_loss(self, trainer, step):
        original_before_loss(self, trainer, step)
        trained.append("tool_mask" in step.inputs and step.inputs is not step.original)

    monkeypatch.setattr(PolicyLag, "before_loss", before_loss)
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="bypass_pg_is", num_iterations=2,
                           max_policy_lag=0, max_steps=2, rollout_dump_dir=str(tmp_path / "dump"))
    trainer.train()
    assert trained == [False, True]  # step 2 reuses step 1's rows: lag 1 > 0, dropped on a copy
    assert recorded == [None, None]


def test_nothing_is_written_when_another_part_refuses_the_setup(llama_dir, tmp_path, make_trainer):
    """Records are built last: routing replay refuses a dense model before the dump folder gets its run.json."""
    dump = tmp_path / "dump"
    with pytest.raises(ValueError, match="routing"):
        make_trainer(llama_dir, tmp_path, rollout_corr_preset="decoupled_token_is", routing_replay="r3",
                     rollout_dump_dir=str(dump))
    assert not (dump / "run.json").exists()
