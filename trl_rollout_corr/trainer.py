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
  (detached) against mu and the loss is PPO-clip on pi_theta / mu (with a dual clip: TRL's ``delta``, else
  ``losses.DEFAULT_DUAL_CLIP``) or REINFORCE ``-A w log pi_theta`` (``losses.bypass_policy_loss``), aggregated as
  TRL's ``loss_type`` does (``trl_compat.aggregate_loss``). The RS mask is the loss mask and normaliser (dapo: the
  pre-RS token count, as verl's engine workers); the advantages were computed at generation time, before pi_theta
  exists, so rows rejected here stay in their group's baseline. Batch normalisation divides by the mean over the
  optimizer step's rows: with gradient accumulation they are scored once, with no grad, at the step's first
  micro-batch (``_batch_norm_all_reduce``).
* No correction configured (no IS, RS or bypass: the default and the ``disabled`` preset): TRL's GRPO, unchanged
  (its batch, advantages, masks and loss as TRL builds them; every ``GRPOConfig`` option accepted), with the
  ``rollout_corr/*`` diagnostics of pi_old vs mu computed on the side where mu exists.
* Metrics (``accumulator.RolloutCorrAccumulator``): ``rollout_corr/*`` are exact over everything trained on since
  the previous log call, on all ranks: the reducible statistics are merged across generation batches /
  micro-batches, reduced across ranks once at log time and finalised once; they are written straight into the log
  record (never averaged again). Decoupled mode records them once per generation batch (at the step that generated
  it); bypass mode once per micro-batch. Also logged: ``rollout_corr/{engine,update,direct}_ratio_{mean,p01,p50,
  p99,max}`` (ratios pi_old/mu, pi_theta/pi_old, pi_theta/mu over the trained tokens, exact order statistics over
  all ranks; bypass: ``direct`` only) and ``rollout_corr/policy_lag_{mean,max}`` (optimizer steps between
  generation and use). In evaluation the keys carry TRL's ``eval_`` prefix.
* Sampling support (``rollout_support_matching``, ``support``): at start-up the sampler contract
  (``rollout_sampler``: what the engine applies, from the config, ``generation_kwargs`` and the model's
  ``generation_config.json``, or a ``rollout_func``'s ``sampler_contract``) and a report of every parameter that
  shapes mu but not the trainer's log-probs (``rollout_sampler_report``). ``"recompute"`` / ``"replay"``: the pi_old
  and pi_theta forwards score over the engine's support (``_support_forward``), missed tokens are made invalid,
  ``rollout_corr/support_*`` are logged. ``"off"`` with truncation: TRL's log-probs, the kept mass measured once on
  the first training batch and reported in one warning.
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
``_compute_loss``, ``log``; private helpers follow the hook that uses them. The rollout-records hook
(``rollout_dump_dir``, ``records.py``) is the last section: one call in four of those hooks, off by default.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from transformers.generation.utils import GenerationMixin
from trl import GRPOTrainer
from trl.trainer.grpo_trainer import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id

from . import model_card, support, trl_compat
from .accumulator import Reducers, RolloutCorrAccumulator
from .config import CORRECTION_FIELDS, RolloutCorrectionConfig
from .correction import make_correction_fn, ratio_decomposition
from .features import RolloutRecords, RoutingReplay, SupportMatching, build_features, check_trainer_args
from .hooks import ForwardCall, GenerationBatch, LossStep, PlainGenerate
from .losses import DEFAULT_DUAL_CLIP, PPOClip, bypass_policy_loss
from .routing import RouteReplayer
from .trainer_config import RolloutCorrGRPOConfig

logger = logging.getLogger(__name__)

__all__ = ["CORRECTION_FIELDS", "RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"]

# transformers' own generate, as imported (a replaced one is detected by identity: ``_plain_generate_has_no_mu``)
_TRANSFORMERS_GENERATE = GenerationMixin.generate


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

    Args: as ``GRPOTrainer``; ``args`` (by position or keyword) must be a ``RolloutCorrGRPOConfig``, or None for
    the default one (``RolloutCorrGRPOConfig("<model name>-GRPO")``, no correction: TRL's GRPO, as
    ``GRPOTrainer(args=None)`` builds ``GRPOConfig("<model name>-GRPO")``).

    With no correction configured the trainer is TRL's, with ``rollout_corr/*`` diagnostics on the side: nothing
    TRL computes (advantages, masks, ``sampling_per_token_logps``, ``old_per_token_logps``, the loss) is changed.

    Attributes:
        rollout_correction: the ``RolloutCorrectionConfig`` in use.
        rollout_corr_metrics: the ``RolloutCorrAccumulator`` that buffers the ``rollout_corr/*`` metrics until
            ``log``.
        rollout_corr_reducers: the cross-rank ``Reducers`` (``.all_reduce`` is the batch-normalisation sum).
        rollout_corr_forward_counts: ``{"old_log_probs": n, "batch_norm_window": m, "version_log_probs": k}``, the
            no-grad policy forwards this trainer ran itself: pi_old per generation batch (decoupled, and
            diagnostics when TRL has none), the optimizer step's rows (bypass + batch normalisation with gradient
            accumulation) and pi_train@v per stale version (``policy_lag_split``); for tests and benchmarks.
        model_card_sections: ``{title: {key: value}}`` tables added to every model card this trainer writes, after
            the correction and rollout-engine tables (``create_model_card``); empty by default.
        rollout_corr_router_replay: the ``routing.RouteReplayer`` of the policy with ``routing_replay="r3"``, else
            None.

    Raises:
        TypeError: if ``args`` is neither None nor a ``RolloutCorrGRPOConfig``.
        ValueError: with a correction configured, when no behaviour log-probs can be obtained (at the first
            generation, naming the fix: e.g. ``model.generate`` replaced by a function that skips transformers'
            sampling), when a row's behaviour log-probs do not match its completion length (naming the row), or
            when a TRL vLLM server does not report processed log-probs. With ``routing_replay="r3"``: at
            construction for a dense model, an unsupported MoE family, TRL's own vLLM path (no routes) or tools; at
            the first generation for missing routes or routes of the wrong shape (naming the row).
    """

    _tag_names = [*GRPOTrainer._tag_names, *model_card.TAGS]  # on the model (add_model_tags) and in every card

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        train_args = bound.arguments.get("args")
        if train_args is None:  # TRL's default, with this trainer's config class
            model = bound.arguments["model"]
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            bound.arguments["args"] = RolloutCorrGRPOConfig(f"{model_name.split('/')[-1]}-GRPO")
        elif not isinstance(train_args, RolloutCorrGRPOConfig):
            raise TypeError(
                "RolloutCorrGRPOTrainer needs args=RolloutCorrGRPOConfig(...) (a GRPOConfig subclass with the "
                f"rollout-correction fields) or args=None, got {type(train_args).__name__}."
            )
        # before TRL loads the model or starts an engine
        check_trainer_args(bound.arguments["args"], bound.arguments)
        super().__init__(*bound.args[1:], **bound.kwargs)
        self.rollout_correction: RolloutCorrectionConfig = self.args.rollout_correction()
        self.rollout_corr_reducers = _accelerate_reducers(self.accelerator)
        self.rollout_corr_metrics = RolloutCorrAccumulator(self.rollout_corr_reducers)
        self.rollout_corr_forward_counts = {"old_log_probs": 0, "batch_norm_window": 0, "version_log_probs": 0}
        self.model_card_sections: dict[str, dict[str, Any]] = {}
        self._rc_correction_fn = make_correction_fn(self.rollout_correction, compile=self.args.rollout_corr_compile)
        # Scoped hand-offs between TRL's hooks: set only inside the context managers below, None/False outside.
        self._gen: Optional[GenerationBatch] = None  # the generation batch in progress
        self._loss: Optional[LossStep] = None  # the micro-batch whose loss is being computed
        self._forward_call: Optional[ForwardCall] = None  # the role of the next forward (``policy_forward``)
        self._rc_warned: set = set()
        # bypass + batch normalisation with gradient accumulation: (optimizer step, global (sum, count)) of the
        # step's rows, computed at its first micro-batch
        self._rc_batch_norm_window: Optional[tuple] = None
        self.rollout_corr_features = build_features(self)
        self._support = self.rollout_corr_features.get(SupportMatching)
        # bypass (pi_old := mu) or routing replay (pi_old recomputed, replayed): TRL's pi_old forward is a placeholder
        self._skip_trl_old = self.rollout_correction.bypass_mode or any(
            f.replaces_trl_old_forward for f in self.rollout_corr_features)

    @property
    def rollout_sampler(self):
        """The ``support.SamplerSpec`` the rollout engine samples with (``features.support_matching``), or None."""
        return self._support.sampler

    @property
    def rollout_sampler_report(self) -> list:
        """The start-up report: one line per sampler parameter that shapes mu but not the trainer's log-probs."""
        return self._support.report

    @property
    def rollout_corr_router_replay(self) -> Optional[RouteReplayer]:
        """The policy's ``routing.RouteReplayer`` with ``routing_replay="r3"``, else None."""
        routing = self.rollout_corr_features.get(RoutingReplay)
        return None if routing is None else routing.replayer

    @property
    def rollout_records(self):
        """The ``records.RolloutRecordWriter`` of ``rollout_dump_dir``, or None (unset)."""
        records = self.rollout_corr_features.get(RolloutRecords)
        return None if records is None else records.writer

    @property
    def _rc_active(self) -> bool:
        """True when a correction is configured (IS, RS or bypass): TRL's training is changed. False: TRL's GRPO
        with diagnostics only."""
        return self.rollout_correction.enabled

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning once per trainer."""
        if message not in self._rc_warned:
            self._rc_warned.add(message)
            logger.warning("RolloutCorrGRPOTrainer: %s.", message)

    @property
    def metrics_mode(self) -> str:
        """``"train"`` or ``"eval"``, as TRL decides it (from the policy's training flag)."""
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ generation: behaviour log-probs (mu)
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation; on the plain ``transformers.generate`` path the features' ``plain_generate`` hooks run
        around it (``BehaviourLogProbs`` captures mu there). Returns ``(completion_ids, logprobs)``."""
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        gen = self._gen or GenerationBatch(started=time.time())  # outside a generation batch: nothing handed on
        call = PlainGenerate(self.accelerator.unwrap_model(self.model), prompt_ids)
        with self.rollout_corr_features.around("plain_generate", self, gen, call):
            call.completion_ids, call.log_probs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self.rollout_corr_features.after("after_plain_generate", self, gen, call)
        return call.completion_ids, call.log_probs

    def _generate(self, prompts: list):
        """TRL's ``_generate``, then the features' ``after_generate`` (versions, routes, mu alignment)."""
        result = super()._generate(prompts)
        if self._gen is not None:
            self.rollout_corr_features.after("after_generate", self, self._gen, result)
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards; the gathered ``(B_global, F)`` tensor also goes to ``GenerationBatch.rewards``."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._gen is not None:
            self._gen.rewards = rewards_per_func
        return rewards_per_func

    # ------------------------------------------------------------------ log-prob forwards: pi_old and pi_theta
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob forward, seen through the scoped interceptions below; on CPU it scores only the trained
        positions through the LM head (``rollout_corr_compact_scoring``, ``trl_compat.score_trained_tokens_only``)."""
        call, self._forward_call = self._forward_call or self._trl_forward_call(model), None
        if call.role == "trl_old" and self._skip_trl_old:
            self._gen.trl_old_skipped = True  # pi_old comes later (or is mu): drop TRL's NaN placeholder then
            placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            return placeholder, None, None
        call.logits_to_keep = logits_to_keep
        with self.rollout_corr_features.around("forward", self, call):
            with trl_compat.score_trained_tokens_only(self.args.rollout_corr_compact_scoring):
                call.result = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
                )
        result = call.result
        if self._loss is not None and self._loss.policy_log_probs is None:
            self._loss.policy_log_probs = result[0].detach()  # the first policy forward of the loss step
        return result

    def _trl_forward_call(self, model) -> ForwardCall:
        """The role of a forward TRL itself starts: in a loss step ``loss``; in a generation batch, the first no-grad
        policy forward is ``trl_old`` when TRL 1.16's rule runs one (pinned in ``tests/test_trl_compat.py``) and
        every other is ``ref`` (a PEFT reference forward runs on the policy with its adapter off); else ``other``."""
        if self._loss is not None:
            return ForwardCall("loss", model, batch=self._loss.inputs)
        gen = self._gen
        if gen is None:
            return ForwardCall("other", model)
        if not gen.trl_old_seen and model is self.model and not torch.is_grad_enabled():
            gen.trl_old_seen = True
            if self._trl_runs_old_forward():
                return ForwardCall("trl_old", model, measure=True)
        return ForwardCall("ref", model)

    def policy_forward(self, call: ForwardCall, fwd: trl_compat.ForwardInputs, **kwargs):
        """One of our own log-prob forwards, with its role (``call``): TRL's forward of ``call.model`` over ``fwd``
        (``trl_compat.prompt_completion_inputs``) with exactly ``kwargs`` (``batch_size``, multimodal keys: the row
        chunking changes float results), seen by the features' ``forward`` hooks. Returns TRL's
        ``(log_probs (B, T), entropies, aux_loss)``."""
        self._forward_call = call
        return self._get_per_token_logps_and_entropies(call.model, fwd.input_ids, fwd.attention_mask,
                                                       fwd.logits_to_keep, **kwargs)

    def _trl_runs_old_forward(self) -> bool:
        """Whether TRL's ``_generate_and_score_completions`` runs its own pi_old forward (its 1.16 rule)."""
        args = self.args
        return trl_compat.trl_computes_old_log_probs(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            steps_per_generation=args.steps_per_generation,
            num_iterations=self.num_iterations,
            use_vllm=self.use_vllm,
            vllm_importance_sampling_correction=self.vllm_importance_sampling_correction,
        )

    # ------------------------------------------------------------------ scoring: the decoupled correction
    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring, then the rollout correction (decoupled) or its inputs (bypass).

        Adds to the returned dict (all ``(B, T)`` per local row, aligned with ``completion_ids``):
        ``rollout_log_probs`` (mu), ``rollout_generation_step`` (0-d), and in decoupled mode
        ``old_per_token_logps`` (pi_old), ``rollout_rs_mask`` (RS + invalid tokens removed) and
        ``rollout_is_weights`` (when IS is on); rewrites ``advantages`` (RS-rejected rows) and
        ``num_items_in_batch`` (kept tokens, global). With no correction configured nothing of TRL's is changed:
        mu goes to ``rollout_log_probs`` only (on the plain generate path TRL has no ``sampling_per_token_logps``,
        so none is left in the batch: TRL's ``off_policy_mask_threshold`` then measures against pi_old, as in TRL),
        and pi_old, when TRL computed none, to ``rollout_old_log_probs``. With routing replay: ``routed_experts``
        (B, P + T, L, k).
        """
        gen = self._gen = GenerationBatch(started=time.time())
        try:
            return self._score_generation(inputs, gen)
        finally:
            self._gen = None

    def _score_generation(self, inputs, gen: GenerationBatch):
        features = self.rollout_corr_features
        with (
            features.around("generation", self, gen),
        ):
            output = super()._generate_and_score_completions(inputs)
        if gen.trl_old_skipped:
            output.pop("old_per_token_logps")  # TRL's placeholder: pi_old comes later (or is mu)
        features.before("on_batch", self, gen, output)
        if not self._rc_active:
            if gen.trl_old_skipped:  # TRL's loss needs its pi_old: recompute it, replayed
                output["old_per_token_logps"] = self._old_log_probs(output)
            self._record_diagnostics(output, gen)
            features.after("after_score", self, gen, output)
            return output
        rollout_log_probs = output.get("sampling_per_token_logps")
        if rollout_log_probs is None:
            raise ValueError(
                "Rollout correction is on but no behaviour log-probs (mu) reached the batch; use vLLM or the plain "
                "transformers.generate path."
            )
        output["rollout_log_probs"] = rollout_log_probs
        # 0-d tensor: TRL's shuffle/split pass it to every micro-batch unchanged
        output["rollout_generation_step"] = torch.tensor(self.state.global_step)
        output["rollout_policy_version"] = gen.versions  # (B,): TRL's shuffle/split keep it with its rows
        if not self.rollout_correction.bypass_mode:  # bypass: pi_old := mu, in the loss
            self._apply_decoupled_correction(output, gen)
        features.after("after_score", self, gen, output)
        return output

    def _record_diagnostics(self, output: dict, gen: GenerationBatch) -> None:
        """No correction configured: the ``rollout_corr/*`` statistics of pi_old vs mu, leaving TRL's batch as TRL
        built it (our own keys only are added)."""
        mu = output.pop("sampling_per_token_logps") if gen.mu_captured else output.get("sampling_per_token_logps")
        if mu is None or gen.mu_unusable is not None:
            self.warn_once(f"no rollout_corr/* diagnostics for a generation batch: {gen.mu_unusable or 'no mu'}")
            return
        output["rollout_log_probs"] = mu
        output["rollout_generation_step"] = torch.tensor(self.state.global_step)
        output["rollout_policy_version"] = gen.versions
        old_log_probs = output.get("old_per_token_logps")
        if old_log_probs is None:  # TRL uses pi_theta.detach() as pi_old here; the diagnostics need it explicitly
            # a forward TRL does not run: its dropout must not consume the random numbers TRL's next forwards and
            # sampling draw (a model with dropout would otherwise train differently from plain TRL)
            device = output["completion_ids"].device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                old_log_probs = output["rollout_old_log_probs"] = self._old_log_probs(output)
        correction = self._rc_correction_fn(
            support.invalidate_misses(old_log_probs, output.get("rollout_support_miss")), mu,
            trl_compat.loss_mask(output), all_reduce=self.rollout_corr_reducers.all_reduce,
        )
        self.rollout_corr_metrics.add_stats(self.metrics_mode, correction.stats)

    def _apply_decoupled_correction(self, output: dict, gen: GenerationBatch) -> None:
        """IS weights and RS mask from pi_old vs mu, once per generation batch; RS-aware advantages (in place)."""
        mask = trl_compat.loss_mask(output)
        old_log_probs = output.get("old_per_token_logps")
        if old_log_probs is None:
            old_log_probs = output["old_per_token_logps"] = self._old_log_probs(output)
        keep_rows = gen.keep_rows  # max_policy_lag: rows already too stale leave like RS
        kept = mask if keep_rows is None else mask * keep_rows[:, None].to(mask.dtype)
        correction = self._rc_correction_fn(
            support.invalidate_misses(old_log_probs, output.get("rollout_support_miss")), output["rollout_log_probs"],
            kept, all_reduce=self.rollout_corr_reducers.all_reduce,
        )
        self.rollout_corr_metrics.add_stats(self.metrics_mode, correction.stats)
        new_mask = correction.response_mask
        output["rollout_rs_mask"] = new_mask
        if correction.weights is not None:
            output["rollout_is_weights"] = correction.weights
        output["num_items_in_batch"] = self.accelerator.gather(new_mask.sum()).sum()
        # rows left without a loss token (RS, or every token invalid): advantage 0, out of the baseline by default
        has_tokens = self.accelerator.gather(mask.sum(dim=1) > 0)
        rejected = self.accelerator.gather((mask.sum(dim=1) > 0) & (new_mask.sum(dim=1) == 0))
        output["advantages"] = self.rows_out_of_baseline(output["advantages"], rejected, has_tokens, gen.rewards)

    def _old_log_probs(self, output: dict) -> torch.Tensor:
        """pi_old: one no-grad forward of the policy over the local generation batch (routes replayed, and their
        mismatch measured, with routing replay on). Returns (B, T) float32."""
        fwd = trl_compat.prompt_completion_inputs(output)
        train = self.metrics_mode == "train"
        batch_size = self.args.per_device_train_batch_size if train else self.args.per_device_eval_batch_size
        self.rollout_corr_forward_counts["old_log_probs"] += 1
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self.policy_forward(ForwardCall("old", self.model, batch=output, measure=True), fwd,
                                            batch_size=batch_size, **fwd.multimodal)
        return old.float()

    def rows_out_of_baseline(
        self, advantages: torch.Tensor, rejected: torch.Tensor, has_tokens: torch.Tensor,
        rewards_per_func: Optional[torch.Tensor], *, count_lone_survivors: bool = True,
    ) -> torch.Tensor:
        """(B_local,) advantages with RS-rejected rows at 0 and (by default) out of their group's baseline
        (``trl_compat.advantages_after_rejection``); keeps TRL's completions table consistent and counts the rows
        left alone in their group (``rollout_corr/rs_lone_survivor_fraction``). ``rejected``, ``has_tokens``:
        (B_global,) bool, gathered."""
        num_generations = self.num_generations if self.metrics_mode == "train" else self.num_generations_eval
        keep_in_baseline = self.args.rs_keep_rejected_in_baseline
        result = trl_compat.advantages_after_rejection(
            advantages,
            rejected,
            rewards_per_func,
            keep_rejected_in_baseline=keep_in_baseline,
            process_index=self.accelerator.process_index,
            reward_weights=self.reward_weights,
            num_generations=num_generations,
            multi_objective_aggregation=self.multi_objective_aggregation,
            scale_rewards=self.scale_rewards,
        )
        if result.all_processes is not None:
            trl_compat.replace_logged_advantages(self._logs["advantages"], result.all_processes)
        elif bool(rejected.any()):  # kept in the baseline: only the rejected rows' advantages changed (to 0)
            logged = torch.tensor(list(self._logs["advantages"])[-rejected.numel():], dtype=torch.float32)
            if logged.numel() == rejected.numel():
                trl_compat.replace_logged_advantages(self._logs["advantages"], logged.masked_fill(rejected.cpu(), 0.0))
        if count_lone_survivors and self.rollout_correction.rs_enabled and not keep_in_baseline:
            lone = trl_compat.lone_survivors(rejected, has_tokens, num_generations)
            self.rollout_corr_metrics.add_fraction(
                self.metrics_mode, "rs_lone_survivor_fraction", int(lone.sum()), int(has_tokens.sum())
            )
        return result.local

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        """Decoupled: TRL's loss with the RS mask as loss mask/normaliser and IS weights after the clip.
        Bypass: ``_bypass_loss``. No correction: TRL's loss on TRL's batch, with the ratio diagnostics.
        Routing replay: the pi_theta forward replays the routes (bypass: and measures their mismatch, as there is no
        pi_old forward). The features' ``before_loss`` / ``after_loss`` run around it (``LossStep``)."""
        step = self._loss = LossStep(original=inputs, inputs=inputs)
        try:
            self.rollout_corr_features.before("before_loss", self, step)
            loss = self._corrected_loss(model, step.inputs)
        finally:
            self._loss = None
        self.rollout_corr_features.after("after_loss", self, step)
        return loss

    def _corrected_loss(self, model, inputs):
        """The body of ``_compute_loss``."""
        if self.rollout_correction.bypass_mode:
            self._batch_norm_all_reduce(model)  # the step's window forward (if any) first: replay blocks do not nest
            return self._bypass_loss(model, inputs)
        loss_inputs = trl_compat.inject_rs_mask_and_is_weights(inputs) if self._rc_active else inputs
        loss = super()._compute_loss(model, loss_inputs)
        mu, policy_log_probs = inputs.get("rollout_log_probs"), self._loss.policy_log_probs
        if policy_log_probs is not None and mu is not None:
            old = inputs.get("old_per_token_logps", inputs.get("rollout_old_log_probs"))
            d = ratio_decomposition(policy_log_probs, old, mu, trl_compat.loss_mask(loss_inputs))
            at_version = inputs.get("rollout_version_log_probs")
            if at_version is None:
                ratios = {"engine": d.engine[d.valid], "update": d.update[d.valid], "direct": d.direct[d.valid]}
            else:  # policy_lag_split: engine pi_train@v / mu, lag pi_old / pi_train@v (engine * lag = pi_old / mu)
                valid = d.valid & torch.isfinite(at_version)
                ratios = {"engine": (at_version - mu.float())[valid], "lag": (old.float() - at_version)[valid],
                          "update": d.update[valid], "direct": d.direct[valid]}
            self.rollout_corr_metrics.add_log_ratios(self.metrics_mode, ratios)
        return loss

    def _bypass_loss(self, model, inputs):
        """Bypass loss for one micro-batch: correction from pi_theta (no grad) vs mu, then PPO-clip on
        pi_theta / mu (dual clip: TRL's ``delta``, else ``losses.DEFAULT_DUAL_CLIP``) or REINFORCE, aggregated like
        TRL's ``loss_type``, plus ``beta`` * KL to pi_ref and the MoE aux loss, as TRL's ``_compute_loss`` adds
        them. Batch normalisation divides by the mean over the optimizer step's rows (``_batch_norm_all_reduce``)."""
        fwd = trl_compat.prompt_completion_inputs(inputs)
        call = ForwardCall("bypass_loss", model, batch=inputs, measure=True)
        per_token_logps, entropies, aux_loss = self.policy_forward(
            call, fwd, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled, **fwd.multimodal,
        )
        rollout_log_probs = support.invalidate_misses(inputs["rollout_log_probs"], call.miss)
        dual_clip = self.args.delta if self.args.delta is not None else DEFAULT_DUAL_CLIP
        out = bypass_policy_loss(
            per_token_logps, rollout_log_probs, inputs["advantages"], trl_compat.loss_mask(inputs),
            self.rollout_correction, correction_fn=self._rc_correction_fn,
            clip=PPOClip(self.epsilon_low, self.epsilon_high, clip_ratio_c=dual_clip),
            all_reduce=self._batch_norm_all_reduce(model),
        )
        keep = out.mask
        self.rollout_corr_metrics.add_stats(self.metrics_mode, out.correction.stats)
        direct = per_token_logps.detach().float() - inputs["rollout_log_probs"].float()
        self.rollout_corr_metrics.add_log_ratios(self.metrics_mode, {"direct": direct[keep & torch.isfinite(direct)]})
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
            self._metrics[self.metrics_mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item()
            )
        self._log_bypass_loss_metrics(keep, entropies, per_token_kl, out)
        return loss

    def _batch_norm_all_reduce(self, model):
        """The batch-normalisation sum for this bypass micro-batch (``compute_rollout_correction(all_reduce=...)``).

        Without batch normalisation, in evaluation, or without gradient accumulation the micro-batch is the step's
        local batch: the cross-rank sum. With gradient accumulation the step's rows are spread over several
        micro-batches whose pi_theta only exists inside their own loss forward; but the weights do not change within
        the step, so at its first micro-batch one no-grad forward scores all of the step's rows (the micro-batches
        TRL will serve next, already generated: ``RolloutCorrGRPOConfig`` checks that they are) and every
        micro-batch of the step then divides by that global mean. Cost: that one forward per optimizer step.
        """
        reducers = self.rollout_corr_reducers
        if not (self.rollout_correction.rollout_is_batch_normalize and self.metrics_mode == "train"
                and self.current_gradient_accumulation_steps > 1):
            return reducers.all_reduce
        step = self.state.global_step
        if self._rc_batch_norm_window is None or self._rc_batch_norm_window[0] != step:
            self._rc_batch_norm_window = (step, self._window_batch_norm_total(model))
        total = self._rc_batch_norm_window[1]
        return lambda _local_total: total

    def _window_batch_norm_total(self, model) -> torch.Tensor:
        """The global (sum of weights, count) over every row of the optimizer step now starting (bypass mode).

        The step's micro-batches are TRL's buffered ``_buffered_inputs[(k + i) % steps_per_generation]`` for its
        micro-steps ``k + i``; their pi_theta is scored with no grad and the correction run on all of them at once
        (its statistics are discarded; only the batch-normalisation total is kept).

        Raises:
            RuntimeError: if called anywhere but at the first micro-batch of an optimizer step.
        """
        accumulation = self.current_gradient_accumulation_steps
        if self._step % accumulation != 0:
            raise RuntimeError(
                f"bypass batch normalisation: the optimizer step's rows must be scored at its first micro-batch, but "
                f"micro-step {self._step} is not a multiple of gradient_accumulation_steps ({accumulation})."
            )
        spg = self.args.steps_per_generation
        chunks = [self._buffered_inputs[(self._step + i) % spg] for i in range(accumulation)]
        log_probs, rollout, masks = [], [], []
        self.rollout_corr_forward_counts["batch_norm_window"] += 1
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for chunk in chunks:
                fwd = trl_compat.prompt_completion_inputs(chunk)
                call = ForwardCall("batch_norm_window", model, batch=chunk)
                lp, _, _ = self.policy_forward(call, fwd, **fwd.multimodal)
                log_probs.append(lp.float())
                rollout.append(support.invalidate_misses(chunk["rollout_log_probs"], call.miss))
                masks.append(trl_compat.loss_mask(chunk))
        captured = []
        cross_rank = self.rollout_corr_reducers.all_reduce

        def capture(local_total: torch.Tensor) -> torch.Tensor:
            captured.append(local_total if cross_rank is None else cross_rank(local_total))
            return captured[-1]

        self._rc_correction_fn(torch.cat(log_probs), torch.cat(rollout), torch.cat(masks), all_reduce=capture)
        return captured[-1]

    def _accumulation_steps(self) -> float:
        """TRL's gradient-accumulation divisor: ``current_gradient_accumulation_steps`` in training, 1 in eval."""
        return self.current_gradient_accumulation_steps if self.metrics_mode == "train" else 1.0

    def _aggregation_kwargs(self, inputs: dict) -> dict:
        """The trainer state ``trl_compat.aggregate_loss`` needs, for this micro-batch and mode."""
        return dict(
            accumulation_steps=self._accumulation_steps(),
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation if self.metrics_mode == "train" else 1,
        )

    def _log_bypass_loss_metrics(self, keep, entropies, per_token_kl, out) -> None:
        """TRL's loss metrics (``kl``, ``entropy``, ``clip_ratio/*``) for the bypass loss, over the kept tokens."""
        metrics, reduce_sum = self._metrics[self.metrics_mode], self.rollout_corr_reducers.all_reduce
        if per_token_kl is not None:
            metrics["kl"].append(trl_compat.global_masked_mean(per_token_kl, keep, reduce_sum))
        metrics["entropy"].append(trl_compat.global_masked_mean(entropies, keep, reduce_sum))
        if out.clipped_high is not None:
            clipped = {"clip_ratio/high_mean": out.clipped_high, "clip_ratio/low_mean": out.clipped_low,
                       "clip_ratio/region_mean": out.clipped_high | out.clipped_low}
            for key, flags in clipped.items():
                metrics[key].append(trl_compat.global_masked_mean(flags.float(), keep, reduce_sum))

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Adds the exact ``rollout_corr/*`` values of everything since the previous call, then TRL's ``log``.

        Runs on every rank (the Trainer calls ``log`` on all processes), so the cross-rank reduction is safe.
        """
        # in place, like TRL: evaluate() returns this dict
        logs.update(self.rollout_corr_metrics.flush(self.metrics_mode))
        self.rollout_corr_features.before("on_log", self, logs)
        super().log(logs, start_time)
        self.rollout_corr_features.after("after_log", self, self.state.log_history[-1])

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
