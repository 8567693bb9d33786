"""The trainer's hook protocol: ``Feature``, ``CorrectionMode``, the ``Features`` container and the per-call objects.

``RolloutCorrGRPOTrainer`` (``trainer.py``) overrides TRL 1.16's hooks and, in each, calls the features (``features/``)
and the one correction mode (``modes/``) in TRL's call order. Features and the mode hand values to each other only
through the per-call objects below and through the batch keys declared once at the end of this module
(``BATCH_KEYS``: writers, readers, shape; ``FORWARD_ROLES``: each forward role's traits), from which
``docs/explanation/architecture.md``'s tables are generated (``docgen``).

The ordering rules (written once, here and in ``features.FEATURES``; tested in
``tests/features/test_features_order.py``):

1. Around hooks (``generation``, ``plain_generate``, ``forward``) nest in list order: entered in ``FEATURES`` order,
   exited in reverse, so an earlier feature encloses every later one.
2. Before hooks (``on_batch``, ``before_loss``, ``on_log``) run in list order; after hooks (``after_plain_generate``,
   ``after_generate``, ``after_score``, ``after_loss``, ``after_log``) run in reverse (first in, last out: a feature's
   "after" sees the work of every feature it encloses).
3. Construction, ``check_config`` and ``check_trainer_args`` run in list order (the one feature with side effects
   outside the process, the rollout records, is last); the mode's ``check_config`` runs after every feature's.
4. The mode scores a generation batch between ``on_batch`` and ``after_score``, and it alone produces the loss. Its
   own ``forward`` hook encloses the features' around every log-prob forward.

The prior art for the shape: torchtitan's model converters (a protocol plus a sequential container built from the
config, undone in reverse) and Composer's algorithm passes (list order, reversed on "after" events).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Literal, Mapping, Optional, Sequence, TypeVar

import torch

if TYPE_CHECKING:  # the trainer's type only; no feature imports trainer.py
    from .trainer import RolloutCorrGRPOTrainer

__all__ = ["AROUND_HOOKS", "AFTER_HOOKS", "BATCH_KEYS", "BATCH_KEY_SCHEMA", "BEFORE_HOOKS", "BatchKey",
           "CorrectionMode", "FORWARD_INPUT_KEYS", "FORWARD_ROLES", "Feature", "Features", "ForwardCall",
           "ForwardRole", "GenerationBatch", "LossStep", "PlainGenerate", "ROLE_TRAITS", "Role", "refuse_config"]


# ---------------------------------------------------------------------------------------------- per-call objects
@dataclass
class GenerationBatch:
    """One call of ``_generate_and_score_completions``: what the hooks of one generation batch hand each other.

    Attributes:
        started: ``time.time()`` when the batch started (unix seconds).
        rewards: (B_global, F) TRL's gathered rewards (``_calculate_rewards``), or None.
        versions: (B,) int64 policy version per local row (``PolicyLag``; ``lag.row_versions``).
        token_versions: (B, T) int64 policy version per completion token when some row spans a weight update (a
            ``rollout_func``'s per-token ``policy_version`` that differs within a row; ``lag.token_versions``), else
            None. A list of per-row lists between ``after_generate`` and ``on_batch``.
        keep_rows: (B,) bool rows within ``max_policy_lag`` at generation; None: no bound (``PolicyLag``).
        routes: per-row expert choices (``RoutingReplay``: recorded by generate or a ``rollout_func``'s, checked).
        mu_captured: mu came from the generate capture, not from TRL (``BehaviourLogProbs``).
        mu_unusable: no correction: why this batch has no diagnostics (``BehaviourLogProbs``), or None.
        record_kept_sets: replay: the generate capture also records the kept-token sets (``SupportMatching``).
        trl_old_seen: TRL's first no-grad policy forward of this batch has run (the trainer: forward roles).
        trl_old_skipped: TRL's own pi_old forward returned a NaN placeholder (the trainer; bypass and routing
            replay replace that forward).
        version_log_probs: the lag split's scorer ``batch -> (B, T) float32 log pi_train@v or None``
            (``LagSplit.version_log_probs``, published in its ``generation`` hook; computed once per batch and stored
            as ``rollout_version_log_probs``), or None without ``policy_lag_split``. The mode calls it when RS judges
            the engine factor (``rollout_rs_on="engine"``).
        support: the support-matched score (``support.SupportScore``, (B, T) fields) of this batch's measured pi_old
            forward (role ``trl_old`` or ``old``; matching on), set by the trainer from ``ForwardCall.support``.
    """

    started: float
    rewards: Optional[torch.Tensor] = None
    versions: Optional[torch.Tensor] = None
    token_versions: Optional[Any] = None
    keep_rows: Optional[torch.Tensor] = None
    routes: Optional[list] = None
    mu_captured: bool = False
    mu_unusable: Optional[str] = None
    record_kept_sets: bool = False
    trl_old_seen: bool = False
    trl_old_skipped: bool = False
    version_log_probs: Optional[Callable[[dict], Optional[torch.Tensor]]] = None
    support: Optional[Any] = None


@dataclass
class PlainGenerate:
    """One ``transformers.generate`` call on TRL's plain path (``_generate_single_turn``).

    Attributes:
        model: the unwrapped policy. prompt_ids: the prompts' token ids (lists, one per row).
        capture: the generate capture (``engines.transformers_generate.capture_generate_log_probs``) once
            ``BehaviourLogProbs`` opened it; None: this generate yields no mu.
        completion_ids: TRL's result, one list of ids per row. log_probs: what ``_generate_single_turn`` returns as
            logprobs (mu per completion token, floats), set by ``BehaviourLogProbs``.
    """

    model: torch.nn.Module
    prompt_ids: list
    capture: Optional[Any] = None
    completion_ids: Optional[list] = None
    log_probs: Optional[list] = None


Role = Literal["trl_old", "ref", "loss", "old", "bypass_loss", "batch_norm_window", "version", "other"]


@dataclass
class ForwardCall:
    """One log-prob forward (``_get_per_token_logps_and_entropies``), as the features see it.

    Attributes:
        role: who started it and why (``docs/explanation/architecture.md``, "Forward roles"): TRL's ``trl_old`` /
        ``ref`` /
            ``loss``, or ours: ``old`` (pi_old), ``bypass_loss``, ``batch_norm_window``, ``version``; ``other``.
        model: the model forwarded.
        batch: the rows scored, in TRL's layout (``prompt_ids``, ``completion_ids``, masks, our keys); None for TRL's
            generation-time forwards (the batch dict does not exist yet).
        measure: count this forward's diagnostics (routing mismatch, support statistics).
        logits_to_keep: the completion length T scored (set by the trainer from TRL's call).
        input_ids, attention_mask: (B, P + T) the tokens forwarded (set by the trainer from TRL's call).
        compute_entropy: the caller wants the entropies (TRL's ``compute_entropy``; set by the trainer).
        result: ``(log_probs (B, T), entropies, aux_loss)`` once the forward ran; a feature's exit may replace it;
            the mode's ``forward`` may set it on entry (the forward then does not run: ``LossStep.reuse``).
        miss: (B, T) bool tokens this forward could not score (sampled outside the trainer's support), or None.
        support: the support-matched score of this forward (``support.SupportScore``: (B, T) ``log_probs``,
            ``log_mass``, ``size``, ``miss``), set by ``SupportMatching`` on exit when matching is on; None otherwise.
    """

    role: Role
    model: torch.nn.Module
    batch: Optional[Mapping[str, Any]] = None
    measure: bool = False
    logits_to_keep: Optional[int] = None
    input_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    compute_entropy: bool = False
    result: Optional[tuple] = None
    miss: Optional[torch.Tensor] = None
    support: Optional[Any] = None


@dataclass
class LossStep:
    """One call of ``_compute_loss``.

    Attributes:
        original: the micro-batch as TRL passed it (what the records store).
        inputs: what the mode trains on (``PolicyLag`` may return a copy whose stale rows are out of the loss mask).
        policy_log_probs: (B, T) detached log-probs of the FIRST policy forward of this loss step (pi_theta for the
            records and the ratio decomposition; for bypass + batch normalisation + accumulation, at a step's first
            micro-batch, the batch-norm window's no-grad forward of the same rows).
        old_from_loss: this loss step's first policy forward is also its batch's pi_old (``old_forward``: set by the
            mode's ``prepare_loss``); the mode's ``forward`` gives it the role ``old`` (routes replayed and measured,
            support scored and measured, missed tokens into the batch) instead of ``loss``.
        reuse: ``(input_ids, attention_mask, logits_to_keep, result)`` of a policy forward the mode ran itself in
            ``prepare_loss``; the mode's ``forward`` answers TRL's own loss forward over the same rows with ``result``
            instead of running it again.
        support: the support-matched score (``support.SupportScore``) of this loss step's measured forward (role
            ``old`` or ``bypass_loss``; matching on), set by the trainer from ``ForwardCall.support``; else None.
        trained_tokens: 0-d int64, the tokens of this micro-batch that carry gradient (in the loss mask after RS and
            the lag filter, with a non-zero IS weight), set by the correction modes' ``loss``; None otherwise.
    """

    original: dict
    inputs: dict
    policy_log_probs: Optional[torch.Tensor] = None
    old_from_loss: bool = False
    reuse: Optional[tuple] = None
    trained_tokens: Optional[torch.Tensor] = None
    support: Optional[Any] = None


# ---------------------------------------------------------------------------------------------- the protocols
def refuse_config(msg: str) -> None:
    """Refuse a ``RolloutCorrGRPOConfig`` (every part's ``check_config`` and ``trainer_config``'s own checks).

    Raises:
        ValueError: always, ``"RolloutCorrGRPOConfig: " + msg``.
    """
    raise ValueError(f"RolloutCorrGRPOConfig: {msg}")


AROUND_HOOKS = ("generation", "plain_generate", "forward")
BEFORE_HOOKS = ("on_batch", "before_loss", "on_log")
AFTER_HOOKS = ("after_plain_generate", "after_generate", "after_score", "after_loss", "after_log")


class Feature:
    """A trainer-side feature: hooks the trainer calls in TRL's order (the module docstring gives the rules).

    Every hook has a no-op default, so a feature overrides only the hooks it needs. A subclass is built from the
    config (``wanted(args)``; ``__init__(trainer)`` after ``GRPOTrainer.__init__``) and listed once in
    ``features.FEATURES``. What it carries across optimizer steps it returns from ``state_dict`` and takes back in
    ``load_state_dict``: every checkpoint saves it, a resumed run restores it (``checkpoint_state``).

    Attributes:
        name: the feature's name (docs, errors).
        replaces_trl_old_forward: with this feature, TRL's own pi_old forward returns a NaN placeholder instead of
            running (``GenerationBatch.trl_old_skipped``).
    """

    name: ClassVar[str] = "feature"
    replaces_trl_old_forward: bool = False

    @classmethod
    def wanted(cls, args) -> bool:
        """Whether this feature is present for ``args`` (a ``RolloutCorrGRPOConfig``)."""
        return True

    @classmethod
    def check_config(cls, args, correction) -> None:
        """Refuse, at construction (``RolloutCorrGRPOConfig.__post_init__``, after ``GRPOConfig.__post_init__``), what
        in ``args`` concerns this feature (``correction``: the validated ``RolloutCorrectionConfig``). Runs for every
        feature in ``FEATURES`` order whether or not it is ``wanted`` (a field's value is checked even when it leaves
        the feature off). Raises ValueError (``refuse_config``) naming the fix."""

    @classmethod
    def check_trainer_args(cls, args, trainer_args: Mapping[str, Any]) -> None:
        """Refuse, before ``GRPOTrainer.__init__`` loads anything, what this feature cannot serve (``trainer_args``:
        ``GRPOTrainer.__init__``'s bound arguments). Raises ValueError naming the fix."""

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        pass

    # one generation batch (TRL: _generate_and_score_completions and what it calls)
    def generation(self, trainer, gen: GenerationBatch) -> contextlib.AbstractContextManager:
        """Around TRL's whole ``_generate_and_score_completions`` call."""
        return contextlib.nullcontext()

    def plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> contextlib.AbstractContextManager:
        """Around one plain ``transformers.generate`` call."""
        return contextlib.nullcontext()

    def after_plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> None:
        """After that call (``call.completion_ids`` is TRL's result)."""

    def after_generate(self, trainer, gen: GenerationBatch, result: tuple) -> None:
        """After TRL's ``_generate``: its tuple (prompt ids, completion ids, tool mask, completions, logprobs, extra
        fields, ...); the extra-fields dict may be changed in place."""

    def on_batch(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """TRL built the batch; the mode has not scored it yet."""

    def after_score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """The mode has scored the batch."""

    # every log-prob forward (TRL: _get_per_token_logps_and_entropies)
    def forward(self, trainer, call: ForwardCall) -> contextlib.AbstractContextManager:
        """Around TRL's forward; may set ``call.result`` / ``call.miss`` on exit."""
        return contextlib.nullcontext()

    # one micro-batch (TRL: _compute_loss)
    def before_loss(self, trainer, step: LossStep) -> None:
        """Before the mode's loss; may replace ``step.inputs``."""

    def after_loss(self, trainer, step: LossStep) -> None:
        """After the mode's loss (``step.policy_log_probs`` is set when a policy forward ran)."""

    # logging (TRL: log)
    def on_log(self, trainer, logs: dict) -> None:
        """Before TRL's ``log``, after the ``rollout_corr/*`` values were added; reads, never rewrites."""

    def after_log(self, trainer, record: Mapping[str, Any]) -> None:
        """After TRL's ``log``: ``record`` is ``state.log_history[-1]``."""

    # checkpoints (``checkpoint_state``: one file per rank in each checkpoint folder, keyed by ``name``)
    def state_dict(self) -> dict:
        """What a run resumed from a checkpoint needs to continue as the uninterrupted run would: this rank's state
        at the checkpoint (ints, floats, strings, tensors, and dicts / lists of them: ``torch.load(weights_only=True)``
        reads it back). Default: {} (a feature whose hooks carry nothing from one optimizer step to the next)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s value from the checkpoint a run resumes from, before its first step (the
        Trainer has loaded the model, the optimizer and ``TrainerState``).

        Raises:
            ValueError: a state this feature cannot take (the default: a non-empty one), naming the fix.
        """
        if state:
            raise ValueError(f"{self.name}: the checkpoint holds state {sorted(state)} for a feature that keeps "
                             "none; it was saved by another version of trl_rollout_corr. Resume with that version.")


class CorrectionMode:
    """How the correction enters training: exactly one per trainer, chosen from the config (``modes.build_mode``).

    Attributes:
        name: ``"diagnostics"`` (no correction), ``"decoupled"`` or ``"bypass"``.
        replaces_trl_old_forward: TRL's own pi_old forward returns a placeholder (bypass: pi_old := mu; decoupled
            with pi_old read from the loss forward where TRL's rule runs one, ``num_iterations > 1``).
        correction_fn: ``correction.make_correction_fn(config, compile=args.rollout_corr_compile)``.
    """

    name: ClassVar[str] = "mode"
    replaces_trl_old_forward: bool = False
    correction_fn: Callable

    @classmethod
    def check_config(cls, args, correction) -> None:
        """Refuse, at construction, what in ``args`` this mode cannot serve; runs for the config's own mode only
        (``modes.mode_class(correction)``), after every feature's ``check_config``. Raises ValueError
        (``refuse_config``) naming the fix."""

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        pass

    def score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """Score one generation batch, between the features' ``on_batch`` and ``after_score``."""

    def forward(self, trainer, call: ForwardCall, step: Optional[LossStep]) -> contextlib.AbstractContextManager:
        """Around every log-prob forward, outside the features' ``forward`` hooks (``step``: the loss step in
        progress, or None). On entry the mode may give a forward TRL started another role (a loss forward that is
        also pi_old's) or answer it (``call.result`` set: neither the features' hooks nor the forward run)."""
        return contextlib.nullcontext()

    def prepare_loss(self, trainer, model: torch.nn.Module, step: LossStep) -> None:
        """Before the features' ``before_loss``: finish what the batch's scoring left to its first loss forward
        (pi_old read from it, ``old_forward``)."""

    def loss(self, trainer, model: torch.nn.Module, step: LossStep,
             trl_loss: Callable[[torch.nn.Module, dict], torch.Tensor]) -> torch.Tensor:
        """The loss of one micro-batch (``trl_loss``: TRL's own ``_compute_loss``)."""
        return trl_loss(model, step.inputs)


F = TypeVar("F", bound=Feature)


class Features:
    """The trainer's features in ``FEATURES`` order, and the three ways to call one hook on all of them.

    Args:
        items: the built features, in ``FEATURES`` order.
    """

    def __init__(self, items: Sequence[Feature]) -> None:
        self.items = tuple(items)

    def __iter__(self) -> Iterator[Feature]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def _implementers(self, hook: str) -> list:
        return [getattr(f, hook) for f in self.items if getattr(type(f), hook) is not getattr(Feature, hook)]

    @contextlib.contextmanager
    def around(self, hook: str, *args) -> Iterator[None]:
        """Enter ``hook(*args)`` of every feature in order; exit in reverse (rule 1)."""
        assert hook in AROUND_HOOKS, hook
        with contextlib.ExitStack() as stack:
            for method in self._implementers(hook):
                stack.enter_context(method(*args))
            yield

    def before(self, hook: str, *args) -> None:
        """Call ``hook(*args)`` of every feature in order (rule 2)."""
        assert hook in BEFORE_HOOKS, hook
        for method in self._implementers(hook):
            method(*args)

    def after(self, hook: str, *args) -> None:
        """Call ``hook(*args)`` of every feature in reverse order (rule 2)."""
        assert hook in AFTER_HOOKS, hook
        for method in reversed(self._implementers(hook)):
            method(*args)

    def get(self, cls: type[F]) -> Optional[F]:
        """The feature of type ``cls``, or None when it is absent for this config."""
        return next((f for f in self.items if isinstance(f, cls)), None)


# ---------------------------------------------------------------------------------------------- the schema
@dataclass(frozen=True)
class ForwardRole:
    """One forward role (``ForwardCall.role``) and its traits, which the features read instead of keeping role lists.

    Attributes:
        name: the role. started_by: who starts such a forward (docs). grad: whether it carries gradient (docs).
        replayed: routing replay replays the batch's recorded routes in it (``RoutingReplay``).
        scored: support matching scores it over the engine's support (``SupportMatching``: matching on, or the
            one-time kept-mass measurement when the call measures).
        pi_theta: what it counts as for ``LossStep.policy_log_probs`` (docs).
        replay, support: what routing replay and support matching do in it, in words (docs).
    """

    name: str
    started_by: str
    grad: str
    replayed: bool
    scored: bool
    pi_theta: str
    replay: str
    support: str


FORWARD_ROLES: tuple[ForwardRole, ...] = (
    ForwardRole("trl_old", "TRL", "no", False, True, "no",
                "never: replaced by a NaN placeholder when the mode (bypass) or a feature (routing) replaces it",
                "measure; replace if matching"),
    ForwardRole("ref", "TRL", "no", False, False, "no", "no", "no"),
    ForwardRole("old", "`trainer.old_log_probs` (modes); the mode's `forward` / `prepare_loss` (pi_old from the loss "
                "forward)", "no (from the loss forward: yes)", True, True, "no (from the loss forward: first in the "
                "loss step)", "replay, measure", "measure; replace if matching"),
    ForwardRole("loss", "TRL's `_compute_loss`", "yes", True, True, "first in the loss step", "replay, no measure",
                "replace if matching"),
    ForwardRole("bypass_loss", "`BypassMode.loss`", "yes", True, True, "first in the loss step", "replay, measure",
                "measure; replace if matching"),
    ForwardRole("batch_norm_window", "`BypassMode` (first micro-batch of a step)", "no", True, True,
                "first in the loss step", "replay, no measure", "replace if matching (else none)"),
    ForwardRole("version", "`LagSplit` (version weights)", "no", True, True, "no",
                "replay (its model's replayer), no measure", "replace if matching"),
    ForwardRole("other", "TRL, outside a generation batch and a loss step", "-", False, False, "no", "no", "no"),
)
ROLE_TRAITS: Mapping[str, ForwardRole] = {role.name: role for role in FORWARD_ROLES}


@dataclass(frozen=True)
class BatchKey:
    """One key of the batch dict between the parts: TRL builds the batch, the parts add keys, TRL's shuffle and split
    carry every (B, ...) key with its rows to the micro-batches of the loss.

    Attributes:
        name: the key. shape: its shape (B: local rows, T: completion length, P: prompt length, F: reward functions).
        writers: the parts that write it (class names; ``"TRL"``). ``tests/trainer/test_batch_schema.py`` fails when a
            part writes a key not declared here, or a key it is not declared a writer of.
        readers: who reads it (docs).
        forward_input: a policy forward over some of the rows takes it with them (``LagSplit``'s version forward;
            a tensor by its rows, a list by the rows' indices).
        note: when it is written, in words (docs).
    """

    name: str
    shape: str
    writers: tuple[str, ...]
    readers: str
    forward_input: bool = False
    note: str = ""


_MODES = ("DiagnosticsMode", "DecoupledMode", "BypassMode")
BATCH_KEYS: tuple[BatchKey, ...] = (
    BatchKey("prompt_ids", "(B, P)", ("TRL",), "every policy forward", forward_input=True),
    BatchKey("prompt_mask", "(B, P)", ("TRL",), "every policy forward", forward_input=True),
    BatchKey("completion_ids", "(B, T)", ("TRL",), "every policy forward", forward_input=True),
    BatchKey("completion_mask", "(B, T)", ("TRL",), "every policy forward, the loss mask", forward_input=True),
    BatchKey("routed_experts", "(B, P + T, L, k) int16", ("RoutingReplay",), "RoutingReplay `forward`, records",
             forward_input=True, note="`on_batch`"),
    BatchKey("rollout_log_probs", "(B, T)", _MODES, "losses, the correction, LagSplit, records",
             note="every mode's `score` (diagnostics only when mu is usable)"),
    BatchKey("rollout_generation_step", "0-d int64", _MODES, "records", note="with `rollout_log_probs`"),
    BatchKey("rollout_policy_version", "(B,) int64", _MODES, "PolicyLag `before_loss`, LagSplit, records",
             note="with `rollout_log_probs`"),
    BatchKey("rollout_policy_version_tokens", "(B, T) int64", _MODES, "LagSplit, records",
             note="with `rollout_log_probs`, only when a row spans a weight update (per-token `policy_version`)"),
    BatchKey("old_per_token_logps", "(B, T)", ("TRL", "DecoupledMode", "DiagnosticsMode"),
             "TRL's loss, the ratio decomposition, LagSplit, records",
             note="TRL's key; decoupled when TRL has none; diagnostics after a replaced TRL pi_old"),
    BatchKey("rollout_old_log_probs", "(B, T)", ("DiagnosticsMode",), "the decomposition, LagSplit, records",
             note="pi_old when TRL has none (no correction)"),
    BatchKey("rollout_generation_row", "(B,) int64", ("DecoupledMode",), "`DecoupledMode.prepare_loss`",
             note="pi_old read from the loss forward: each row's place in generation order"),
    BatchKey("rollout_support", "list of B `support.KeptTokens`", ("SupportMatching",), "SupportMatching `forward`",
             forward_input=True, note="replay, `on_batch`"),
    BatchKey("rollout_support_miss", "(B, T) bool", ("SupportMatching",), "the modes (`support.invalidate_misses`), "
             "records", note="matching on: the measured pi_old forward's missed tokens"),
    BatchKey("rollout_rs_mask", "(B, T) float", ("DecoupledMode", "PolicyLag"),
             "`trl_compat.inject_rs_mask_and_is_weights`, records",
             note="PolicyLag: on its `before_loss` copy, stale rows out (`lag.drop_stale_rows`)"),
    BatchKey("rollout_is_weights", "(B, T) or (B, 1)", ("DecoupledMode",),
             "`trl_compat.inject_rs_mask_and_is_weights`, records", note="IS on"),
    BatchKey("num_items_in_batch", "0-d", ("TRL", "DecoupledMode"), "TRL's loss normaliser",
             note="decoupled: the kept tokens, global"),
    BatchKey("advantages", "(B,)", ("TRL",) + _MODES[1:], "TRL's loss, the bypass loss, records",
             note="rows rejected (decoupled: RS or stale; bypass: stale) out of their group's baseline"),
    BatchKey("tool_mask", "(B, T)", ("TRL", "PolicyLag"), "the loss mask",
             note="PolicyLag: on its `before_loss` copy (bypass with a max lag), stale rows out"),
    BatchKey("rollout_version_log_probs", "(B, T)", ("LagSplit",), "the decomposition in the loss, RS on the engine "
             "factor, records", note="LagSplit `after_score`, or its scorer (`GenerationBatch.version_log_probs`) "
             "run by the mode"),
    BatchKey("rollout_record_row", "(B,) int64", ("RolloutRecords",), "records `after_loss`", note="`on_batch`"),
    BatchKey("rollout_record_batch", "0-d int64", ("RolloutRecords",), "records `after_loss`", note="`on_batch`"),
    BatchKey("rollout_record_rewards", "(B, F)", ("RolloutRecords",), "records `after_loss`", note="`on_batch`"),
    BatchKey("rollout_record_times", "(B, 2) float64", ("RolloutRecords",), "records `after_loss`",
             note="`on_batch`"),
    *(BatchKey(f"rollout_record_support_{name}", "(B, T)", ("RolloutRecords",), "records `after_loss`",
               note="matching on: the measured forward's score (`GenerationBatch.support` in `after_score`, "
                    "`LossStep.support` in `after_loss`)") for name in ("log_mass", "size", "miss")),
)
BATCH_KEY_SCHEMA: Mapping[str, BatchKey] = {key.name: key for key in BATCH_KEYS}
FORWARD_INPUT_KEYS: tuple[str, ...] = tuple(key.name for key in BATCH_KEYS if key.forward_input)
