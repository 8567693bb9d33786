"""``RolloutCorrGRPOTrainer``: TRL's GRPO with rollout correction (decoupled or bypass mode).

A drop-in ``GRPOTrainer`` subclass: change the import and the config class, add a few fields::

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    args = RolloutCorrGRPOConfig(..., rollout_corr_preset="decoupled_k3_rs_token_tis")
    trainer = RolloutCorrGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

Four policies are kept apart (README, "Vocabulary"): mu (``rollout_log_probs``, from the rollout engine: vLLM
processed log-probs, or the processed scores of ``transformers.generate``), pi_old (``old_log_probs``, one trainer
forward per generation batch, decoupled mode only), pi_theta (the loss forward) and pi_ref (TRL's ``beta`` KL
anchor, never used for the correction).

* Decoupled mode: right after generation, IS weights and the RS mask are computed once from
  ``log pi_old - log mu``; rows that RS rejects entirely get advantage 0 and leave their group's mean/std
  (``rs_keep_rejected_in_baseline=True`` keeps them in, as verl does); the loss is TRL's own PPO-clip loss (any
  of ``trl_compat.SUPPORTED_LOSS_TYPES["decoupled"]``) with the RS mask as loss mask and normaliser and the IS
  weights multiplying the clipped per-token loss (``trl_compat.inject_rs_mask_and_is_weights``).
* Bypass mode: no pi_old forward; in every micro-batch the correction is computed from the current pi_theta
  (detached) against mu and the loss is PPO-clip on pi_theta / mu or REINFORCE ``-A w log pi_theta``
  (``losses.bypass_policy_loss``), aggregated as TRL's ``loss_type`` does (``trl_compat.aggregate_loss``). The RS
  mask is the loss mask and normaliser (dapo: the pre-RS token count, as verl's engine workers); the advantages
  were computed at generation time, before pi_theta exists, so rows rejected here stay in their group's baseline.
* Metrics (``accumulator.RolloutCorrAccumulator``): ``rollout_corr/*`` are exact over everything trained on since
  the previous log call, on all ranks: the reducible statistics are merged across generation batches /
  micro-batches, reduced across ranks once at log time and finalised once; they are written straight into the log
  record (never averaged again). Decoupled mode records them once per generation batch (at the step that generated
  it); bypass mode once per micro-batch. Also logged: ``rollout_corr/{engine,update,direct}_ratio_{mean,p01,p50,
  p99,max}`` (ratios pi_old/mu, pi_theta/pi_old, pi_theta/mu over the trained tokens, exact order statistics over
  all ranks; bypass: ``direct`` only) and ``rollout_corr/policy_lag_{mean,max}`` (optimizer steps between
  generation and use). In evaluation the keys carry TRL's ``eval_`` prefix.
* Routing replay (``routing_replay="r3"``, MoE models; ``routing.py``, ``docs/routing-replay.md``): the rollout's
  expert choices ride in the batch as ``routed_experts`` and are replayed in the pi_old and pi_theta forwards;
  ``rollout_corr/routing_mismatch_fraction`` (overall, ``/layer_<i>``) and ``routing_token_mismatch_fraction``.

Who knows TRL 1.16's internals: this file (the overridden hooks, their signatures and call order, TRL's private
``_metrics`` / ``_logs`` / ``vllm_generation`` attributes, the ``GRPOConfig`` fields checked in
``RolloutCorrGRPOConfig``) and ``trl_compat.py`` (the TRL formulas the hooks must mirror). Both are pinned by
``tests/test_trl_compat.py``, which fails loudly if the pinned TRL changes under them. (``engines/vllm_cpu.py``'s
``rollout_func`` adaptor also reads trainer attributes; see its docstring.)

The class reads top to bottom in the order TRL calls its hooks: ``__init__``, ``_generate_single_turn``,
``_generate``, ``_calculate_rewards``, ``_get_per_token_logps_and_entropies``, ``_generate_and_score_completions``,
``_compute_loss``, ``log``; private helpers follow the hook that uses them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.grpo_trainer import disable_gradient_checkpointing

from . import model_card, trl_compat
from .accumulator import Reducers, RolloutCorrAccumulator
from .config import CORRECTION_FIELDS, RolloutCorrectionArguments, RolloutCorrectionConfig
from .correction import make_correction_fn, ratio_decomposition
from .engines.alignment import check_aligned
from .engines.transformers_generate import GENERATE_DTYPES, capture_generate_log_probs, generate_in_dtype
from .losses import PPOClip, bypass_policy_loss
from .routing import RouteReplayer, check_row_routes, pad_routes, record_routes

logger = logging.getLogger(__name__)

ROUTING_REPLAY_MODES = ("off", "r3")

__all__ = ["CORRECTION_FIELDS", "RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"]


@dataclass
class RolloutCorrGRPOConfig(RolloutCorrectionArguments, GRPOConfig):
    r"""``GRPOConfig`` plus rollout correction.

    The correction fields (``rollout_corr_preset`` and the fields of ``config.CORRECTION_FIELD_TABLE``) come from
    ``RolloutCorrectionArguments``, flat, so each works as a ``TrlParser``/``HfArgumentParser`` flag
    (``--rollout_is token``) and as a YAML key; explicitly set fields override the preset, and after construction
    the flat fields hold the effective values (``args.rollout_correction()`` is the validated config).
    (``RolloutCorrectionArguments`` comes first among the bases so that ``TrainingArguments``' fields keep their
    positions: ``RolloutCorrGRPOConfig("out")`` sets ``output_dir``, as ``GRPOConfig("out")`` does.)

    Parameters:
        rs_keep_rejected_in_baseline (`bool`, defaults to `False`):
            Decoupled mode: keep rows that RS rejects entirely in their group's reward mean/std (verl's
            behaviour). Default False: they leave the baseline. Their own advantage is 0 either way.
        rollout_corr_compile (`bool`, defaults to `False`):
            Run the correction math through ``torch.compile`` (``correction.make_correction_fn(..., compile=True)``):
            same values, faster on large batches; the first step pays the compile. Used in both modes.
        routing_replay (`str`, defaults to `"off"`):
            ``"r3"``: Rollout Routing Replay for mixture-of-experts models (``routing.py``): the rollout's expert
            choices (``transformers.generate``: recorded while sampling; a ``rollout_func``: its ``routed_experts``)
            travel with the batch as ``routed_experts`` and the policy forwards (pi_old, pi_theta; not pi_ref) route
            every token to them; ``rollout_corr/routing_mismatch_fraction`` (overall, ``/layer_<i>``) and
            ``rollout_corr/routing_token_mismatch_fraction`` count the trainer's own differing choices before
            substitution. ``"off"``: no capture, no replay.
        rollout_generate_dtype (`str`, *optional*):
            Plain ``transformers.generate`` path only: sample from a ``bfloat16`` / ``float16`` / ``float32`` copy of
            the weights (``engines.transformers_generate.generate_in_dtype``), e.g. a bf16 rollout engine next to a
            float32 trainer. Unset: generate with the weights as they are.
        vllm_importance_sampling_correction (`bool`, *optional*):
            TRL's own vLLM IS correction. Unset: off when this config's correction is enabled (IS, RS or bypass),
            TRL's default (on) otherwise. Setting it True together with an enabled correction is an error
            (the two would both apply).

    Raises:
        ValueError / TypeError: at construction, for an invalid correction field, an unknown preset, or an
            incompatible combination (the message names the options involved).
    """

    rs_keep_rejected_in_baseline: bool = field(
        default=False,
        metadata={"help": "Keep fully RS-rejected rows in their GRPO group's mean/std (verl). Default: excluded."},
    )
    rollout_corr_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the correction math (same values, several times faster on large batches); the "
            "first step pays the compile (tens of seconds on CPU)."
        },
    )
    routing_replay: str = field(
        default="off",
        metadata={
            "help": "MoE models: 'r3' replays the rollout's expert choices in the policy forwards (Rollout Routing "
            "Replay) and logs rollout_corr/routing_mismatch_fraction; 'off' (default): the trainer routes itself.",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )
    rollout_generate_dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": "transformers.generate path: sample from a copy of the weights in this dtype "
            f"({', '.join(GENERATE_DTYPES)}), e.g. a bf16 rollout engine next to a float32 trainer. Unset: as loaded."
        },
    )
    vllm_importance_sampling_correction: Optional[bool] = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM IS correction. Unset: off when rollout correction is enabled, else TRL's default "
            "(on). True together with an enabled rollout correction is an error."
        },
    )

    def __post_init__(self):
        correction = self.resolve()
        self._store_effective_fields(correction)
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = not correction.enabled
            if correction.enabled and self.use_vllm:
                logger.warning(
                    "Rollout correction is enabled, so TRL's own vLLM importance-sampling correction "
                    "(vllm_importance_sampling_correction) is switched off: the mismatch is corrected once, by "
                    "trl_rollout_corr."
                )
        elif self.vllm_importance_sampling_correction and correction.enabled:
            raise ValueError(
                "vllm_importance_sampling_correction=True and rollout correction (rollout_is / rollout_rs / "
                "bypass_mode) are both enabled: the mismatch would be corrected twice. Unset "
                "vllm_importance_sampling_correction (it is then switched off) or disable the rollout correction."
            )
        GRPOConfig.__post_init__(self)
        self._check_compatibility(correction)

    def _check_generate_dtype(self, fail) -> None:
        if self.rollout_generate_dtype is None:
            return
        if self.rollout_generate_dtype not in GENERATE_DTYPES:
            fail(
                f"rollout_generate_dtype must be one of {tuple(GENERATE_DTYPES)} or unset, "
                f"got {self.rollout_generate_dtype!r}."
            )
        if self.use_vllm:
            fail(
                "rollout_generate_dtype applies to the transformers.generate path only; with use_vllm=True the "
                "rollout dtype is vLLM's own (its model dtype); unset rollout_generate_dtype."
            )

    def _check_routing_replay(self, fail) -> None:
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            fail(f"routing_replay must be one of {ROUTING_REPLAY_MODES}, got {self.routing_replay!r}.")
        if self.routing_replay == "r3" and self.use_vllm and self.vllm_importance_sampling_correction:
            fail(
                "routing_replay='r3' with TRL's own vLLM importance sampling (vllm_importance_sampling_correction="
                "True): TRL's pi_old forward for it cannot replay the routes. Use this package's correction "
                "(e.g. rollout_is='token'; TRL's is then switched off) or set "
                "vllm_importance_sampling_correction=False."
            )

    def _check_compatibility(self, correction: RolloutCorrectionConfig) -> None:
        """Refuse the TRL options the correction cannot serve (each message names the option and the fix)."""

        def fail(msg: str) -> None:
            raise ValueError(f"RolloutCorrGRPOConfig: {msg}")

        if self.use_transformers_continuous_batching:
            fail(
                "use_transformers_continuous_batching=True returns no behaviour log-probs, so rollout correction "
                "cannot run; use the plain transformers.generate path (use_transformers_continuous_batching=False) "
                "or vLLM."
            )
        self._check_generate_dtype(fail)
        self._check_routing_replay(fail)
        if self.loss_type == "vespo":
            fail(
                "loss_type='vespo' applies its own importance weighting; it cannot be combined with rollout "
                "correction."
            )
        mode = "bypass" if correction.bypass_mode else "decoupled"
        supported = trl_compat.SUPPORTED_LOSS_TYPES[mode]
        if not correction.bypass_mode:
            if self.loss_type not in supported:
                fail(f"decoupled mode supports loss_type in {supported}, got {self.loss_type!r}.")
            return
        # Bypass mode: our own loss replaces TRL's, so only what it reproduces is allowed.
        if self.rs_keep_rejected_in_baseline:
            logger.warning(
                "rs_keep_rejected_in_baseline has no effect in bypass mode: RS runs in the loss, after the "
                "advantages, so rejected rows always stay in their group's baseline."
            )
        if self.loss_type not in supported:
            fail(f"bypass_mode=True supports loss_type in {supported}, got {self.loss_type!r}.")
        unsupported = {
            "importance_sampling_level": (self.importance_sampling_level != "token", "'token'"),
            "top_entropy_quantile": (self.top_entropy_quantile < 1.0, "1.0"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, "None"),
            "entropy_coef": (self.entropy_coef != 0.0, "0.0"),
            "use_adaptive_entropy": (bool(self.use_adaptive_entropy), "False"),
            "delta": (self.delta is not None, "None"),
        }
        for name, (bad, needed) in unsupported.items():
            if bad:
                fail(f"bypass_mode=True replaces TRL's loss and does not support {name}={getattr(self, name)!r}; "
                     f"set {name}={needed}.")


@dataclass
class _Slot:
    """A value handed from a TRL hook to the code that opened the scope (see the scoped helpers below)."""

    value: Any = None


def _check_routing_sources(args: RolloutCorrGRPOConfig, trainer_args: dict) -> None:
    """``routing_replay="r3"`` needs routes from the generation path: refuse, before anything loads, TRL's own vLLM
    path (it returns none: use a ``rollout_func`` returning ``routed_experts``, e.g. built with
    ``routing.routes_from_vllm_outputs``) and tools / environments (multi-turn rollouts: the tool turns' routes are
    not stitched). ``trainer_args``: ``GRPOTrainer.__init__``'s bound arguments."""
    if args.routing_replay != "r3":
        return
    if args.use_vllm and trainer_args.get("rollout_func") is None:
        raise ValueError(
            "routing_replay='r3' needs the rollout's routed experts, which TRL's own vLLM path does not return; "
            "generate with a rollout_func that returns 'routed_experts' (trl_rollout_corr.routing."
            "routes_from_vllm_outputs, vLLM on GPU with enable_return_routed_experts=True) or with "
            "transformers.generate (use_vllm=False)."
        )
    if trainer_args.get("tools") or trainer_args.get("environment_factory"):
        raise ValueError(
            "routing_replay='r3' does not support tools or environments yet (the routes of multi-turn rollouts are "
            "not stitched across tool calls); set routing_replay='off'."
        )


def _accelerate_reducers(accelerator) -> Reducers:
    """Cross-rank sum/max/min/gather through ``accelerate`` (identities on one process)."""
    if accelerator.num_processes <= 1:
        return Reducers()

    def extreme(op):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            torch.distributed.all_reduce(t, op=op)
            return t

        return reduce

    return Reducers(
        world_size=accelerator.num_processes,
        sum=lambda t: accelerator.reduce(t, reduction="sum"),
        max=extreme(torch.distributed.ReduceOp.MAX),
        min=extreme(torch.distributed.ReduceOp.MIN),
        gather=accelerator.gather,
    )


class RolloutCorrGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout correction; see the module docstring.

    Args: as ``GRPOTrainer``; ``args`` (by position or keyword) must be a ``RolloutCorrGRPOConfig``.

    Attributes:
        rollout_correction: the ``RolloutCorrectionConfig`` in use.
        rollout_corr_metrics: the ``RolloutCorrAccumulator`` that buffers the ``rollout_corr/*`` metrics until
            ``log``.
        rollout_corr_reducers: the cross-rank ``Reducers`` (``.all_reduce`` is the batch-normalisation sum).
        rollout_corr_forward_counts: ``{"old_log_probs": n}``, the pi_old forwards this trainer ran itself (for
            tests and benchmarks).
        model_card_sections: ``{title: {key: value}}`` tables added to every model card this trainer writes, after
            the correction and rollout-engine tables (``create_model_card``); empty by default.
        rollout_corr_router_replay: the ``routing.RouteReplayer`` of the policy with ``routing_replay="r3"``, else
            None.

    Raises:
        TypeError: if ``args`` is not a ``RolloutCorrGRPOConfig``.
        ValueError: when no behaviour log-probs can be obtained (at the first generation, naming the fix), when
            a row's behaviour log-probs do not match its completion length (naming the row), or when a TRL vLLM
            server does not report processed log-probs. With ``routing_replay="r3"``: at construction for a dense
            model, an unsupported MoE family, TRL's own vLLM path (no routes) or tools; at the first generation for
            missing routes or routes of the wrong shape (naming the row).
    """

    _tag_names = [*GRPOTrainer._tag_names, *model_card.TAGS]  # on the model (add_model_tags) and in every card

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        train_args = bound.get("args")
        if not isinstance(train_args, RolloutCorrGRPOConfig):
            raise TypeError(
                "RolloutCorrGRPOTrainer needs args=RolloutCorrGRPOConfig(...) (a GRPOConfig subclass with the "
                f"rollout-correction fields), got {type(train_args).__name__}."
            )
        _check_routing_sources(train_args, bound)  # before TRL loads the model or starts an engine
        super().__init__(*args, **kwargs)
        self.rollout_correction: RolloutCorrectionConfig = self.args.rollout_correction()
        self.rollout_corr_reducers = _accelerate_reducers(self.accelerator)
        self.rollout_corr_metrics = RolloutCorrAccumulator(self.rollout_corr_reducers)
        self.rollout_corr_forward_counts = {"old_log_probs": 0}
        self.model_card_sections: dict[str, dict[str, Any]] = {}
        self._rc_correction_fn = make_correction_fn(self.rollout_correction, compile=self.args.rollout_corr_compile)
        # Scoped hand-offs between TRL's hooks: set only inside the context managers below, None/False outside.
        self._rc_skip_old_forward = False
        self._rc_policy_logps: Optional[_Slot] = None
        self._rc_rewards: Optional[_Slot] = None
        self._rc_routes: Optional[_Slot] = None
        self._check_rollout_source()
        self.rollout_corr_router_replay = self._setup_routing_replay()

    def _check_rollout_source(self) -> None:
        """Vendor-specific checks of where mu comes from (the vLLM server's log-prob mode; a ``rollout_func``)."""
        if self.use_vllm and self.args.vllm_mode == "server" and self.accelerator.is_main_process:
            trl_compat.check_vllm_server_logprobs(self.vllm_generation.vllm_client)
        if self.args.rollout_generate_dtype is not None and self.rollout_func is not None:
            raise ValueError(
                "rollout_generate_dtype applies to the transformers.generate path, but a rollout_func generates "
                "here; cast inside the rollout_func (engines.transformers_generate.generate_in_dtype) and unset it."
            )

    def _setup_routing_replay(self) -> Optional[RouteReplayer]:
        """``routing_replay="r3"``: the policy's ``RouteReplayer`` (its hooks do nothing outside ``_replay_routes``).

        Raises:
            ValueError: from ``routing.find_moe_routers`` (a dense model, an unsupported MoE family).
        """
        return RouteReplayer(self.model) if self.args.routing_replay == "r3" else None

    @property
    def _mode(self) -> str:
        """``"train"`` or ``"eval"``, as TRL decides it (from the policy's training flag)."""
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ generation: behaviour log-probs (mu)
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, plus behaviour log-probs on the ``transformers.generate`` path.

        vLLM (colocate/server) and ``rollout_func`` already return the sampled tokens' processed log-probs.
        On the plain ``generate`` path TRL returns none: ``generate`` is shadowed for this call so that it also
        records the processed scores (``engines.transformers_generate``), from a ``rollout_generate_dtype`` copy of
        the weights when set. Returns ``(completion_ids, logprobs)`` with ``logprobs[i]`` a list of floats as long
        as ``completion_ids[i]``. With ``routing_replay="r3"`` the routers' choices are recorded too
        (``_keep_generated_routes``).
        """
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        with (
            generate_in_dtype(unwrapped, self.args.rollout_generate_dtype),
            capture_generate_log_probs(unwrapped) as capture,
            self._record_generate_routes() as routes,
        ):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self._keep_generated_routes(routes, prompt_ids, completion_ids)
        return completion_ids, capture.completion_log_probs(completion_ids)

    def _record_generate_routes(self):
        """With routing replay on, a ``routing.record_routes`` block over the policy's routers; else a no-op."""
        replayer = self.rollout_corr_router_replay
        return contextlib.nullcontext() if replayer is None else record_routes(replayer.routers)

    def _keep_generated_routes(self, recording, prompt_ids, completion_ids) -> None:
        """Cut each row's routes out of the ``generate`` recording, for ``_collect_routes`` (via ``_hold_routes``)."""
        if recording is not None and self._rc_routes is not None:
            self._rc_routes.value = recording.generate_rows([len(p) for p in prompt_ids],
                                                            [len(c) for c in completion_ids])

    def _generate(self, prompts: list):
        """TRL's ``_generate``; checks that every row has one behaviour log-prob per completion token."""
        result = super()._generate(prompts)
        completion_ids, logprobs = result[1], result[4]
        if logprobs is None:
            raise ValueError(
                "Rollout correction is on but the generation path returned no behaviour log-probs (mu). Use vLLM "
                "(use_vllm=True, which requests processed log-probs), the plain transformers.generate path, or a "
                "rollout_func that returns 'logprobs'."
            )
        check_aligned([len(ids) for ids in completion_ids], logprobs)
        self._collect_routes(result)
        return result

    def _collect_routes(self, result: tuple) -> None:
        """With routing replay on: the rows' routes (a ``rollout_func``'s ``routed_experts``, or what
        ``_generate_single_turn`` recorded), checked against the rows (``routing.check_row_routes``), into the
        ``_hold_routes`` slot. Raises ValueError for missing routes or routes of the wrong shape (naming the row)."""
        replayer, slot = self.rollout_corr_router_replay, self._rc_routes
        if replayer is None or slot is None:
            return
        prompt_ids, completion_ids, extra_fields = result[0], result[1], result[5]
        rows = extra_fields.pop("routed_experts", None) if self.rollout_func is not None else slot.value
        if rows is None:
            raise ValueError(
                "routing_replay='r3' but the generation returned no routes: a rollout_func must return "
                "'routed_experts' (one (prompt + completion tokens, MoE layers, top-k) array per row; see "
                "trl_rollout_corr.routing)."
            )
        slot.value = check_row_routes(rows, [len(p) for p in prompt_ids], [len(c) for c in completion_ids],
                                      replayer.routers)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards; inside ``_hold_rewards`` the gathered ``(B_global, F)`` tensor is also handed over."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._rc_rewards is not None:
            self._rc_rewards.value = rewards_per_func
        return rewards_per_func

    @contextlib.contextmanager
    def _hold_routes(self) -> Iterator[_Slot]:
        """Within the block, the generation's per-row routes go into the yielded slot (routing replay on)."""
        self._rc_routes = slot = _Slot()
        try:
            yield slot
        finally:
            self._rc_routes = None

    @contextlib.contextmanager
    def _hold_rewards(self) -> Iterator[_Slot]:
        """Within the block, ``_calculate_rewards`` puts TRL's gathered rewards into the yielded slot."""
        self._rc_rewards = slot = _Slot()
        try:
            yield slot
        finally:
            self._rc_rewards = None

    # ------------------------------------------------------------------ log-prob forwards: pi_old and pi_theta
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob forward, seen through the two scoped interceptions below."""
        if self._rc_skip_old_forward and model is self.model and not torch.is_grad_enabled():
            self._rc_skip_old_forward = False  # one shot: TRL's pi_old forward is its first no-grad policy call
            placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            return placeholder, None, None
        result = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._rc_policy_logps is not None and self._rc_policy_logps.value is None:
            self._rc_policy_logps.value = result[0].detach()  # the loss forward inside GRPOTrainer._compute_loss
        return result

    @contextlib.contextmanager
    def _skip_trl_old_logps_forward(self) -> Iterator[None]:
        """Bypass mode: within the block, TRL's own pi_old forward (when its rule runs one) returns a NaN
        placeholder instead of running; bypass uses mu as pi_old. Routing replay: likewise, and pi_old is computed
        afterwards with the routes replayed (``_attach_routes`` drops the placeholder). Pinned: TRL's pi_old
        forward is the first no-grad call on the policy in ``_generate_and_score_completions`` (before the reference
        forward)."""
        args = self.args
        skip = self.rollout_correction.bypass_mode or self.rollout_corr_router_replay is not None
        self._rc_skip_old_forward = skip and trl_compat.trl_computes_old_log_probs(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            steps_per_generation=args.steps_per_generation,
            num_iterations=self.num_iterations,
            use_vllm=self.use_vllm,
            vllm_importance_sampling_correction=self.vllm_importance_sampling_correction,
        )
        try:
            yield
        finally:
            self._rc_skip_old_forward = False

    @contextlib.contextmanager
    def _capture_policy_logps(self) -> Iterator[_Slot]:
        """Within the block, the first log-prob forward's (B, T) log-probs (detached) go into the yielded slot."""
        self._rc_policy_logps = slot = _Slot()
        try:
            yield slot
        finally:
            self._rc_policy_logps = None

    # ------------------------------------------------------------------ scoring: the decoupled correction
    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring, then the rollout correction (decoupled) or its inputs (bypass).

        Adds to the returned dict (all ``(B, T)`` per local row, aligned with ``completion_ids``):
        ``rollout_log_probs`` (mu), ``rollout_generation_step`` (0-d), and in decoupled mode
        ``old_per_token_logps`` (pi_old), ``rollout_rs_mask`` (RS + invalid tokens removed) and
        ``rollout_is_weights`` (when IS is on); rewrites ``advantages`` (RS-rejected rows) and
        ``num_items_in_batch`` (kept tokens, global). With routing replay: ``routed_experts`` (B, P + T, L, k).
        """
        with self._skip_trl_old_logps_forward(), self._hold_rewards() as rewards, self._hold_routes() as routes:
            output = super()._generate_and_score_completions(inputs)
        rollout_log_probs = output.get("sampling_per_token_logps")
        if rollout_log_probs is None:
            raise ValueError(
                "Rollout correction is on but no behaviour log-probs (mu) reached the batch; use vLLM or the plain "
                "transformers.generate path."
            )
        output["rollout_log_probs"] = rollout_log_probs
        # 0-d tensor: TRL's shuffle/split pass it to every micro-batch unchanged
        output["rollout_generation_step"] = torch.tensor(self.state.global_step)
        self._attach_routes(output, routes.value)
        if self.rollout_correction.bypass_mode:
            output.pop("old_per_token_logps", None)  # bypass: pi_old := mu, handled in the loss
            return output
        self._apply_decoupled_correction(output, rewards.value)
        return output

    def _attach_routes(self, output: dict, rows: Optional[list]) -> None:
        """Routing replay: ``output["routed_experts"]``, (B, P + T, L, k) int16 aligned with ``prompt_ids`` +
        ``completion_ids`` (-1 at padding; a (B, ...) tensor, so TRL's shuffle and split keep it with its rows).
        Decoupled mode also drops TRL's pi_old placeholder: ``_old_log_probs`` recomputes it with replay."""
        if self.rollout_corr_router_replay is None:
            return
        if rows is None:
            raise ValueError("routing_replay='r3' but no routes reached the batch (see _collect_routes).")
        output["routed_experts"] = pad_routes(rows, output["prompt_mask"], output["completion_ids"].size(1))
        if not self.rollout_correction.bypass_mode:
            output.pop("old_per_token_logps", None)

    @contextlib.contextmanager
    def _replay_routes(self, batch: dict, *, measure: bool) -> Iterator[None]:
        """With routing replay on: within the block, the policy's forwards over ``batch`` (TRL's prompt +
        completion layout) use its ``routed_experts``; ``measure`` adds the routing mismatch counts to
        ``rollout_corr/routing_*`` (``RolloutCorrAccumulator.add_fraction_counts``). Off: a no-op."""
        replayer = self.rollout_corr_router_replay
        if replayer is None:
            yield
            return
        routes = batch.get("routed_experts")
        if routes is None:
            raise ValueError("routing_replay='r3' but this batch carries no 'routed_experts'.")
        on_counts = functools.partial(self.rollout_corr_metrics.add_fraction_counts, self._mode) if measure else None
        input_ids = trl_compat.prompt_completion_inputs(batch).input_ids
        with replayer.replay(routes, input_ids, measure=measure, on_counts=on_counts):
            yield

    def _apply_decoupled_correction(self, output: dict, rewards_per_func: Optional[torch.Tensor]) -> None:
        """IS weights and RS mask from pi_old vs mu, once per generation batch; RS-aware advantages (in place)."""
        mask = trl_compat.loss_mask(output)
        old_log_probs = output.get("old_per_token_logps")
        if old_log_probs is None:
            old_log_probs = output["old_per_token_logps"] = self._old_log_probs(output)
        correction = self._rc_correction_fn(
            old_log_probs, output["rollout_log_probs"], mask, all_reduce=self.rollout_corr_reducers.all_reduce
        )
        self.rollout_corr_metrics.add_stats(self._mode, correction.stats)
        new_mask = correction.response_mask
        output["rollout_rs_mask"] = new_mask
        if correction.weights is not None:
            output["rollout_is_weights"] = correction.weights
        output["num_items_in_batch"] = self.accelerator.gather(new_mask.sum()).sum()
        rejected = (mask.sum(dim=1) > 0) & (new_mask.sum(dim=1) == 0)
        output["advantages"] = self._advantages_after_rejection(output["advantages"], rejected, rewards_per_func)

    def _old_log_probs(self, output: dict) -> torch.Tensor:
        """pi_old: one no-grad forward of the policy over the local generation batch (routes replayed, and their
        mismatch measured, with routing replay on). Returns (B, T) float32."""
        fwd = trl_compat.prompt_completion_inputs(output)
        batch_size = (
            self.args.per_device_train_batch_size if self._mode == "train" else self.args.per_device_eval_batch_size
        )
        self.rollout_corr_forward_counts["old_log_probs"] += 1
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            self._replay_routes(output, measure=True),
        ):
            old, _, _ = self._get_per_token_logps_and_entropies(
                self.model, fwd.input_ids, fwd.attention_mask, fwd.logits_to_keep, batch_size=batch_size,
                **fwd.multimodal,
            )
        return old.float()

    def _advantages_after_rejection(
        self, advantages: torch.Tensor, rejected_local: torch.Tensor, rewards_per_func: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """(B_local,) advantages with RS-rejected rows at 0 and (by default) out of their group's baseline
        (``trl_compat.advantages_after_rejection``); keeps TRL's completions table consistent."""
        result = trl_compat.advantages_after_rejection(
            advantages,
            self.accelerator.gather(rejected_local),
            rewards_per_func,
            keep_rejected_in_baseline=self.args.rs_keep_rejected_in_baseline,
            process_index=self.accelerator.process_index,
            reward_weights=self.reward_weights,
            num_generations=self.num_generations if self._mode == "train" else self.num_generations_eval,
            multi_objective_aggregation=self.multi_objective_aggregation,
            scale_rewards=self.scale_rewards,
        )
        if result.all_processes is not None:
            trl_compat.replace_logged_advantages(self._logs["advantages"], result.all_processes)
        return result.local

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        """Decoupled: TRL's loss with the RS mask as loss mask/normaliser and IS weights after the clip.
        Bypass: ``_bypass_loss``. Routing replay: the pi_theta forward replays the routes (bypass: and measures
        their mismatch, as there is no pi_old forward)."""
        self._record_policy_lag(inputs)
        if self.rollout_correction.bypass_mode:
            with self._replay_routes(inputs, measure=True):
                return self._bypass_loss(model, inputs)
        inputs = trl_compat.inject_rs_mask_and_is_weights(inputs)
        with self._capture_policy_logps() as policy_logps, self._replay_routes(inputs, measure=False):
            loss = super()._compute_loss(model, inputs)
        if policy_logps.value is not None:
            d = ratio_decomposition(policy_logps.value, inputs["old_per_token_logps"], inputs["rollout_log_probs"],
                                    inputs["tool_mask"])
            self.rollout_corr_metrics.add_log_ratios(
                self._mode, {"engine": d.engine[d.valid], "update": d.update[d.valid], "direct": d.direct[d.valid]}
            )
        return loss

    def _record_policy_lag(self, inputs: dict) -> None:
        step = inputs.get("rollout_generation_step")
        if step is not None:
            self.rollout_corr_metrics.add_policy_lag(self._mode, self.state.global_step - int(step))

    def _bypass_loss(self, model, inputs):
        """Bypass loss for one micro-batch: correction from pi_theta (no grad) vs mu, then PPO-clip on
        pi_theta / mu or REINFORCE, aggregated like TRL's ``loss_type``, plus ``beta`` * KL to pi_ref and the MoE
        aux loss, as TRL's ``_compute_loss`` adds them."""
        fwd = trl_compat.prompt_completion_inputs(inputs)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, fwd.input_ids, fwd.attention_mask, fwd.logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **fwd.multimodal,
        )
        out = bypass_policy_loss(
            per_token_logps, inputs["rollout_log_probs"], inputs["advantages"], trl_compat.loss_mask(inputs),
            self.rollout_correction, correction_fn=self._rc_correction_fn,
            clip=PPOClip(self.epsilon_low, self.epsilon_high), all_reduce=self.rollout_corr_reducers.all_reduce,
        )
        keep = out.mask
        self.rollout_corr_metrics.add_stats(self._mode, out.correction.stats)
        direct = per_token_logps.detach().float() - inputs["rollout_log_probs"].float()
        self.rollout_corr_metrics.add_log_ratios(self._mode, {"direct": direct[keep & torch.isfinite(direct)]})
        per_token_loss, per_token_kl = out.per_token_loss, None
        if self.beta != 0.0:
            # bias-corrected KL as TRL: times the policy ratio, here pi_theta / mu (bypass: pi_old := mu)
            anchor = inputs["rollout_log_probs"] if self.args.use_bias_correction_kl else None
            per_token_kl = trl_compat.per_token_kl(
                per_token_logps, inputs["ref_per_token_logps"], keep, bias_correction_old_log_probs=anchor
            )
            per_token_loss = per_token_loss + self.beta * torch.where(keep, per_token_kl, 0.0)
        loss = trl_compat.aggregate_loss(per_token_loss, keep, self.loss_type, **self._aggregation_kwargs(inputs))
        if self.aux_loss_enabled:  # MoE router load-balancing loss, scaled for gradient accumulation as TRL does
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation_steps()
            self._metrics[self._mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item()
            )
        self._log_bypass_loss_metrics(keep, entropies, per_token_kl, out)
        return loss

    def _accumulation_steps(self) -> float:
        """TRL's gradient-accumulation divisor: ``current_gradient_accumulation_steps`` in training, 1 in eval."""
        return self.current_gradient_accumulation_steps if self._mode == "train" else 1.0

    def _aggregation_kwargs(self, inputs: dict) -> dict:
        """The trainer state ``trl_compat.aggregate_loss`` needs, for this micro-batch and mode."""
        return dict(
            accumulation_steps=self._accumulation_steps(),
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation if self._mode == "train" else 1,
        )

    def _log_bypass_loss_metrics(self, keep, entropies, per_token_kl, out) -> None:
        """TRL's loss metrics (``kl``, ``entropy``, ``clip_ratio/*``) for the bypass loss, over the kept tokens."""
        metrics, reduce_sum = self._metrics[self._mode], self.rollout_corr_reducers.all_reduce
        if per_token_kl is not None:
            metrics["kl"].append(trl_compat.global_masked_mean(per_token_kl, keep, reduce_sum))
        metrics["entropy"].append(trl_compat.global_masked_mean(entropies, keep, reduce_sum))
        if out.clipped_high is not None:
            for key, clipped in (("clip_ratio/high_mean", out.clipped_high), ("clip_ratio/low_mean", out.clipped_low)):
                metrics[key].append(trl_compat.global_masked_mean(clipped.float(), keep, reduce_sum))

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Adds the exact ``rollout_corr/*`` values of everything since the previous call, then TRL's ``log``.

        Runs on every rank (the Trainer calls ``log`` on all processes), so the cross-rank reduction is safe.
        """
        logs.update(self.rollout_corr_metrics.flush(self._mode))  # in place, like TRL: evaluate() returns this dict
        super().log(logs, start_time)

    # ------------------------------------------------------------------ model card
    def create_model_card(self, model_name: Optional[str] = None, dataset_name: Optional[str] = None, tags=None):
        """TRL's model card, plus the rollout-correction section (``model_card.render_section``).

        TRL calls this for every card it writes (``_save_checkpoint``, ``push_to_hub``, so also ``save_model`` with
        ``push_to_hub=True``), always into ``args.output_dir/README.md``; the section records the effective
        correction config, the rollout engine and ``model_card_sections`` (``model_card.complete_card``, which also
        names local base weights where TRL's template prints ``None``). ``model_name`` defaults to the name TRL's
        ``_save_checkpoint`` gives (the last part of ``hub_model_id``, else of ``output_dir``).
        """
        if model_name is None:
            model_name = (self.args.hub_model_id or Path(self.args.output_dir).name).split("/")[-1]
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            model_card.complete_card(Path(self.args.output_dir) / "README.md", self)
