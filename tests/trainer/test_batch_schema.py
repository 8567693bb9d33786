"""The batch keys in code (``hooks.BATCH_KEYS``, issue 48): every key a feature or a mode writes is declared, with that
part among its writers, checked on real training steps.

``WriteWatch`` wraps every hook of every feature (``Features._implementers``), the mode's ``score``,
``prepare_loss``, ``forward`` and ``loss`` and the lag split's scorer, and compares the batch dicts each call can see
(``batch``; a ``LossStep``'s ``original`` and ``inputs``; a ``ForwardCall``'s ``batch``) before and after it: a key
that is new, or whose value is another object, was written by that call. A write is charged to the innermost call that
made it (a feature's forward hook inside the mode's ``score`` writes for itself). The golden cases
(``tests/trainer/test_trainer_golden.py``: every mode, every feature) run under the watch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_trainer_golden import CASES, run_case

from trl_rollout_corr import hooks
from trl_rollout_corr.features.lag_split import LagSplit
from trl_rollout_corr.hooks import AROUND_HOOKS, BATCH_KEY_SCHEMA, Feature, Features, ForwardCall, LossStep


def _views(args) -> dict:
    """The batch dicts visible from a call's arguments, by slot."""
    out = {}
    for i, arg in enumerate(args):
        if isinstance(arg, dict):
            out[f"arg{i}"] = arg
        elif isinstance(arg, LossStep):
            out["step.original"], out["step.inputs"] = arg.original, arg.inputs
        elif isinstance(arg, ForwardCall) and isinstance(arg.batch, dict):
            out["call.batch"] = arg.batch
    return out


class WriteWatch:
    """Records ``(part, key)`` for every batch key a watched call writes (module docstring)."""

    def __init__(self) -> None:
        self.writes: set[tuple[str, str]] = set()
        self._claimed: set[tuple[int, str, int]] = set()  # (dict, key, value) already charged to an inner call
        self._alive: list = []  # keeps charged values alive, so that their ids stay unique

    def _snapshot(self, args) -> dict:
        return {slot: dict(d) for slot, d in _views(args).items()}

    def _charge(self, part: str, args, before: dict) -> None:
        for slot, now in _views(args).items():
            old = before.get(slot, {})
            for key, value in now.items():
                if key in old and old[key] is value:
                    continue
                mark = (id(now), key, id(value))
                if mark in self._claimed:
                    continue
                self._claimed.add(mark)
                self._alive.append((now, value))
                self.writes.add((part, key))

    @contextlib.contextmanager
    def call(self, part: str, args):
        before = self._snapshot(args)
        try:
            yield
        finally:
            self._charge(part, args, before)

    def wrap(self, method, part: str, around: bool):
        if around:
            @contextlib.contextmanager
            def watched_cm(*args):
                with self.call(part, args), method(*args):
                    yield
            return watched_cm

        def watched(*args):
            with self.call(part, args):
                return method(*args)
        return watched


def undeclared(writes: set[tuple[str, str]]) -> list[str]:
    """The writes the schema does not declare: an unknown key, or a part not among the key's writers."""
    out = []
    for part, key in sorted(writes):
        spec = BATCH_KEY_SCHEMA.get(key)
        if spec is None:
            out.append(f"{part} writes {key!r}, which hooks.BATCH_KEYS does not declare")
        elif part not in spec.writers:
            out.append(f"{part} writes {key!r}, whose declared writers are {spec.writers}")
    return out


@pytest.fixture
def watch(monkeypatch) -> WriteWatch:
    """A ``WriteWatch`` on every feature hook, the mode and the lag split's scorer of the trainers built meanwhile."""
    import trl_rollout_corr.trainer as trainer_module

    w = WriteWatch()
    implementers = Features._implementers

    def watched_implementers(self, hook):
        return [w.wrap(m, type(m.__self__).__name__, hook in AROUND_HOOKS) for m in implementers(self, hook)]

    monkeypatch.setattr(Features, "_implementers", watched_implementers)
    scorer = LagSplit.version_log_probs

    def watched_scorer(self, trainer, batch):
        with w.call("LagSplit", (batch,)):
            return scorer(self, trainer, batch)

    monkeypatch.setattr(LagSplit, "version_log_probs", watched_scorer)
    build_mode = trainer_module.build_mode

    def watched_build_mode(trainer):
        mode = build_mode(trainer)
        for name in ("score", "prepare_loss", "loss", "forward"):
            setattr(mode, name, w.wrap(getattr(mode, name), type(mode).__name__, name == "forward"))
        return mode

    monkeypatch.setattr(trainer_module, "build_mode", watched_build_mode)
    return w


# what each case must show the watch seeing (so that a watch that sees nothing cannot pass)
EXPECTED = {
    "no_correction": {("DiagnosticsMode", "rollout_log_probs"), ("DiagnosticsMode", "rollout_old_log_probs")},
    "no_correction_r3": {("RoutingReplay", "routed_experts"), ("DiagnosticsMode", "rollout_old_log_probs")},
    "decoupled_k3rs_tis_iter2_lag_split_max_lag0_records": {
        ("DecoupledMode", "rollout_rs_mask"), ("DecoupledMode", "rollout_is_weights"),
        ("LagSplit", "rollout_version_log_probs"),
        ("RolloutRecords", "rollout_record_row"), ("PolicyLag", "rollout_rs_mask")},
    "decoupled_support_recompute_r3": {("SupportMatching", "rollout_support_miss"),  # pi_old from the loss forward
                                       ("DecoupledMode", "num_items_in_batch"),
                                       ("DecoupledMode", "rollout_generation_row")},
    "bypass_ppo_batch_norm_ga2_support_r3_records": {
        ("BypassMode", "rollout_log_probs"), ("RolloutRecords", "rollout_record_support_log_mass")},
    "bypass_reinforce_max_lag": {("BypassMode", "rollout_policy_version"), ("PolicyLag", "tool_mask")},
    "decoupled_stale_rollout_lag_split": {("LagSplit", "rollout_version_log_probs"),
                                          ("DecoupledMode", "old_per_token_logps")},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parts_write_only_declared_batch_keys(case, watch, request, tmp_path):
    torch.set_num_threads(1)
    run_case(case, request, tmp_path)
    assert not undeclared(watch.writes), "\n".join(undeclared(watch.writes))
    assert EXPECTED[case] <= watch.writes, sorted(EXPECTED[case] - watch.writes)


@pytest.mark.unit
def test_the_watch_charges_an_undeclared_key_to_its_writer():
    """A feature that writes an undeclared key, under the watch: reported, naming it; the inner call's write is not
    charged to the outer one."""
    class Sneaky(Feature):
        def on_batch(self, trainer, gen, batch):
            batch["rollout_sneaky"] = torch.zeros(1)
            batch["advantages"] = torch.ones(1)  # a TRL key rewritten by a part that is not declared its writer

    w = WriteWatch()
    batch = {"advantages": torch.zeros(1), "prompt_ids": torch.zeros(1)}
    features = Features([Sneaky(None)])
    with w.call("DecoupledMode", (batch,)):  # an outer call: the writes are Sneaky's
        for method in features._implementers("on_batch"):
            w.wrap(method, "Sneaky", False)(None, None, batch)
    assert w.writes == {("Sneaky", "rollout_sneaky"), ("Sneaky", "advantages")}
    assert undeclared(w.writes) == [
        "Sneaky writes 'advantages', whose declared writers are ('TRL', 'DecoupledMode', 'BypassMode')",
        "Sneaky writes 'rollout_sneaky', which hooks.BATCH_KEYS does not declare"]


@pytest.mark.unit
def test_schema_tables_are_consistent():
    """Each key and role declared once; the roles are exactly ``hooks.Role``'s; the role traits match the words the
    docs print; the forward inputs are the rows, their routes and their kept-token sets (support replay)."""
    import typing

    assert len(BATCH_KEY_SCHEMA) == len(hooks.BATCH_KEYS)
    assert set(hooks.ROLE_TRAITS) == set(typing.get_args(hooks.Role))
    for role in hooks.FORWARD_ROLES:
        assert role.replayed == role.replay.startswith("replay"), role
        assert role.scored == ("replace if matching" in role.support), role
    assert hooks.FORWARD_INPUT_KEYS == ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                        "routed_experts", "rollout_support")
