"""``RolloutCorrGRPOTrainer``: TRL's GRPO with rollout correction (decoupled or bypass mode).

A drop-in ``GRPOTrainer`` subclass: change the import and the config class, add a few fields::

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    args = RolloutCorrGRPOConfig(..., rollout_corr_preset="decoupled_k3_rs_token_tis")
    trainer = RolloutCorrGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

Four policies are kept apart (README, "Vocabulary"): mu (``rollout_log_probs``, from the rollout
engine), pi_old (``old_log_probs``, one trainer forward per generation batch, decoupled mode only), pi_theta (the loss
forward) and pi_ref (TRL's ``beta`` KL anchor, never used for the correction).

The class holds only TRL 1.16's overrides, each a few lines of dispatch in TRL's call order (``__init__``,
``_generate_single_turn``, ``_generate``, ``_calculate_rewards``, ``_get_per_token_logps_and_entropies``,
``_generate_and_score_completions``, ``_compute_loss``, ``log``, ``create_model_card``; ``get_train_dataloader`` and
``train`` for asynchronous generation, ``async_generation.py``), and the services that read
TRL's private state (``_metrics``, ``_logs``, ``_buffered_inputs``, ``_step``). The work is done by:

* the correction mode (``modes/``: diagnostics without a correction, decoupled or bypass), which scores each
  generation batch and produces the loss;
* the features (``features/``, in the one order of ``features.FEATURES``: behaviour log-probs, policy lag, routing
  replay, support matching, the lag split, rollout records), called through the hook protocol of ``hooks.py``.

``docs/explanation/architecture.md`` gives the protocol, the ordering rules, the forward roles and the batch keys. Who
knows TRL
1.16's internals: this file and the ``trl_compat`` package, both pinned by ``tests/trainer/test_trl_compat.py``.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from trl import GRPOTrainer
from trl.trainer.grpo_trainer import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id

from . import checkpoint_state, model_card, trl_compat
from .accumulator import Reducers, RolloutCorrAccumulator
from .async_generation import AsyncGeneration, LookAheadLoader
from .config import CORRECTION_FIELDS, RolloutCorrectionConfig
from .features import RolloutRecords, RoutingReplay, SupportMatching, build_features, check_trainer_args
from .hooks import ForwardCall, GenerationBatch, LossStep, PlainGenerate
from .modes import build_mode
from .routing import RouteReplayer
from .trainer_config import RolloutCorrGRPOConfig

logger = logging.getLogger(__name__)

__all__ = ["CORRECTION_FIELDS", "RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"]


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
        rank=accelerator.process_index,
        sum=lambda t: accelerator.reduce(t, reduction="sum"),
        max=extreme(torch.distributed.ReduceOp.MAX),
        min=extreme(torch.distributed.ReduceOp.MIN),
        gather=accelerator.gather,
    )


def _trl_vllm_engine(args: RolloutCorrGRPOConfig):
    """The context in which ``GRPOTrainer.__init__`` builds TRL's vLLM backend: for colocate mode,
    ``trl_compat.trl_vllm_colocate`` (``rollout_vllm_dtype`` / ``rollout_vllm_enforce_eager`` passed to TRL's
    ``vllm.LLM``; on vLLM's CPU platform eager by default and the weight sync inside vLLM's layerwise reload);
    otherwise nothing."""
    import contextlib

    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return contextlib.nullcontext()
    from .engines.vllm_cpu import vllm_on_cpu

    on_cpu = vllm_on_cpu()
    llm_kwargs: dict[str, Any] = {}
    if args.rollout_vllm_dtype is not None:
        llm_kwargs["dtype"] = args.rollout_vllm_dtype
    eager = args.rollout_vllm_enforce_eager
    if eager is None and on_cpu:
        eager = True
    if eager is not None:
        llm_kwargs["enforce_eager"] = eager
    return trl_compat.trl_vllm_colocate(llm_kwargs, layerwise_sync=on_cpu)


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
        rollout_corr_forward_counts: ``{"old_log_probs": n, "batch_norm_window": m, "version_log_probs": k,
            "old_from_loss": e}``: the no-grad policy forwards this trainer ran itself (pi_old per generation batch,
            in decoupled mode and the diagnostics when TRL has none; the optimizer step's rows for bypass + batch
            normalisation with gradient accumulation; pi_train@v per stale version, ``policy_lag_split``), and the
            generation batches whose pi_old was read from their first loss forward instead
            (``rollout_corr_old_forward``); for tests and benchmarks.
        rollout_corr_old_forward_plan: the ``old_forward.OldForwardPlan`` of the mode (None in bypass mode).
        model_card_sections: ``{title: {key: value}}`` tables added to every model card this trainer writes, after
            the correction and rollout-engine tables (``create_model_card``); empty by default.
        rollout_corr_mode: the ``hooks.CorrectionMode`` in use (``modes/``); ``.correction_fn`` is the correction.
        rollout_corr_features: the ``hooks.Features`` present for this config, in ``features.FEATURES`` order.
        rollout_corr_router_replay, rollout_sampler, rollout_sampler_report, rollout_records: properties over the
            features (the policy's ``routing.RouteReplayer``, the sampler contract and its start-up report, the
            rollout-records writer; None where the feature is off).

    Raises:
        TypeError: if ``args`` is neither None nor a ``RolloutCorrGRPOConfig``.
        ValueError: what a feature or the mode refuses, naming the fix: at construction (before TRL loads anything
            where it can) or at the first generation (no behaviour log-probs, misaligned ones, missing or misshapen
            routes); each feature's class docstring (``features/``) lists its errors. ``fsdp=`` set where
            accelerate drops it (CPU ranks: ``trl_compat.dropped_fsdp``).
        NotImplementedError: ``policy_lag_split`` on FSDP1 (``version_store``).
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
        check_trainer_args(bound.arguments["args"], bound.arguments)  # before TRL loads the model or an engine
        if bound.arguments["args"].use_vllm and bound.arguments["args"].vllm_mode == "server":
            trl_compat.install_vllm_client_cpu_weight_sync()  # CPU trainers: gloo weight sync; CUDA: TRL's NCCL
        with _trl_vllm_engine(bound.arguments["args"]):
            super().__init__(*bound.args[1:], **bound.kwargs)
        if trl_compat.dropped_fsdp(self.args, self.accelerator):
            raise ValueError(
                f"fsdp={self.args.fsdp!r} is set, but accelerate runs {self.accelerator.distributed_type} without "
                "FSDP: accelerate 1.15 keeps FSDP only on accelerator devices (GPU, XPU, ...), and on CPU ranks "
                "(use_cpu=True) silently runs DDP. Run FSDP on GPUs (recipes/accelerate/fsdp2.yaml), or unset fsdp "
                "to train with DDP, or DeepSpeed ZeRO-3 for sharding on CPU ranks "
                "(recipes/accelerate/CPU_MULTI_RANK.md)."
            )
        self.rollout_correction: RolloutCorrectionConfig = self.args.rollout_correction()
        self.rollout_corr_reducers = _accelerate_reducers(self.accelerator)
        self.rollout_corr_metrics = RolloutCorrAccumulator(self.rollout_corr_reducers)
        self.rollout_corr_forward_counts = {"old_log_probs": 0, "batch_norm_window": 0, "version_log_probs": 0,
                                            "old_from_loss": 0}
        self.model_card_sections: dict[str, dict[str, Any]] = {}
        # the per-call objects: set only while TRL is inside the hook that opened them
        self._gen: Optional[GenerationBatch] = None  # the generation batch in progress
        self._loss: Optional[LossStep] = None  # the micro-batch whose loss is being computed
        self._forward_call: Optional[ForwardCall] = None  # the role of the next forward (``policy_forward``)
        self._warned: set = set()
        self.rollout_corr_mode = build_mode(self)
        self.rollout_corr_features = build_features(self)
        self.rollout_corr_resume_from: Optional[str] = None  # the checkpoint train() resumes from (checkpoint_state)
        self.rollout_corr_state_saved: Optional[tuple[str, int]] = None  # (folder, step) saved before a push
        self.add_callback(checkpoint_state.callback(self))  # every feature's state saved and restored
        self._skip_trl_old = self.rollout_corr_mode.replaces_trl_old_forward or any(
            f.replaces_trl_old_forward for f in self.rollout_corr_features)
        # compact scoring only with a correction configured: on some shapes the LM head's matmul over fewer rows
        # rounds differently (bench_step's tiny Llama: grad norm 1.9e-6 off at step 3), and without a correction
        # the trainer must be plain TRL bit for bit
        self._compact_scoring = self.args.rollout_corr_compact_scoring and self.rollout_corr_mode.name != "diagnostics"
        # asynchronous generation (issue 45): None at rollout_async_depth=0, TRL's synchronous path untouched
        self.rollout_async = AsyncGeneration(self) if self.args.rollout_async_depth else None

    @property
    def rollout_sampler(self):
        return self.rollout_corr_features.get(SupportMatching).sampler

    @property
    def rollout_sampler_report(self) -> list:
        return self.rollout_corr_features.get(SupportMatching).report

    @property
    def rollout_corr_router_replay(self) -> Optional[RouteReplayer]:
        """The policy's ``routing.RouteReplayer`` with ``routing_replay="r3"``, else None."""
        routing = self.rollout_corr_features.get(RoutingReplay)
        return None if routing is None else routing.replayer

    @property
    def rollout_corr_old_forward_plan(self):
        """Where pi_old comes from (``old_forward.OldForwardPlan``; None in bypass mode: pi_old := mu)."""
        return getattr(self.rollout_corr_mode, "old_forward_plan", None)

    @property
    def rollout_records(self):
        """The ``records.RolloutRecordWriter`` of ``rollout_dump_dir``, or None (unset)."""
        records = self.rollout_corr_features.get(RolloutRecords)
        return None if records is None else records.writer

    # ------------------------------------------------------------------ asynchronous generation
    def get_train_dataloader(self):
        """TRL's training dataloader; with ``rollout_async_depth`` it starts the engine and looks ahead
        (``async_generation.LookAheadLoader``: the same items, in the same order)."""
        loader = super().get_train_dataloader()
        return loader if self.rollout_async is None else self.rollout_async.start(loader)

    def train(self, *args, **kwargs):
        """TRL's ``train``; the asynchronous engine process and worker stop when it ends, also on an exception or
        Ctrl-C.

        With ``rollout_async_depth``, a resume restarts the pipeline at the checkpoint's step R (``async_generation``:
        the first d steps train batches generated with the weights of step R).

        Resumed from a checkpoint, every feature's state is restored from it when training begins
        (``checkpoint_state``).

        Raises:
            ValueError: a resume the pipeline cannot restart exactly (``AsyncGeneration.resume_micro_step``); a
                checkpoint without this trainer's feature state or of other features (``checkpoint_state.load``).
        """
        bound = inspect.signature(GRPOTrainer.train).bind(self, *args, **kwargs).arguments
        self.rollout_corr_resume_from = trl_compat.resume_checkpoint(self.args, bound.get("resume_from_checkpoint"))
        if self.rollout_async is None:
            return super().train(*args, **kwargs)
        try:
            with trl_compat.loader_skips_itself(LookAheadLoader):
                return super().train(*args, **kwargs)
        finally:
            self.rollout_async.close()

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation; on the plain ``transformers.generate`` path the features' ``plain_generate`` hooks run
        around it (``BehaviourLogProbs`` captures mu there). Returns ``(completion_ids, logprobs)``."""
        if self.rollout_async is not None and self.model.training:  # generated ahead, by the engine's process
            return self.rollout_async.take(prompt_ids)
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
        """TRL's ``_generate``, then the features' ``after_generate`` (routes, versions, mu alignment)."""
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

    # ------------------------------------------------------------------ log-prob forwards
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob forward inside the features' ``forward`` hooks (by role, ``ForwardCall``); on CPU it scores
        only the trained positions through the LM head (``rollout_corr_compact_scoring``,
        ``trl_compat.score_trained_tokens_only``). TRL's own pi_old forward returns a (B, T) NaN placeholder when the
        mode or a feature replaces it. The mode's ``forward`` hook encloses the features' (and may answer the call);
        a measured forward's support score goes to the generation batch or loss step in progress (``.support``)."""
        call, self._forward_call = self._forward_call or self._trl_forward_call(model), None
        if call.role == "trl_old" and self._skip_trl_old:
            self._gen.trl_old_skipped = True
            return torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device), None, None
        call.logits_to_keep, call.input_ids, call.attention_mask = logits_to_keep, input_ids, attention_mask
        call.compute_entropy = bool(kwargs.get("compute_entropy", False))
        step = self._loss
        with self.rollout_corr_mode.forward(self, call, step):
            if call.result is None:  # not answered by the mode
                with self.rollout_corr_features.around("forward", self, call):
                    with trl_compat.score_trained_tokens_only(self._compact_scoring):
                        call.result = super()._get_per_token_logps_and_entropies(
                            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
                        )
        if step is not None and step.policy_log_probs is None:
            step.policy_log_probs = call.result[0].detach()  # the first policy forward of the loss step
        owner = step if step is not None else self._gen
        if call.measure and call.support is not None and owner is not None:
            owner.support = call.support
        return call.result

    def _trl_forward_call(self, model) -> ForwardCall:
        """The role of a forward TRL itself starts: in a loss step ``loss`` (the mode's ``forward`` may make it
        ``old``); in a generation batch, the first no-grad policy forward is ``trl_old`` when TRL 1.16's rule runs
        one (pinned in ``tests/trainer/test_trl_compat.py``) and every other is ``ref`` (a PEFT reference forward runs
        on the policy with its adapter off); else ``other``."""
        step = self._loss
        if step is not None:
            return ForwardCall("loss", model, batch=step.inputs)
        gen = self._gen
        if gen is None:
            return ForwardCall("other", model)
        if not gen.trl_old_seen and model is self.model and not torch.is_grad_enabled():
            gen.trl_old_seen = True
            args = self.args
            if trl_compat.trl_computes_old_log_probs(
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                steps_per_generation=args.steps_per_generation, num_iterations=self.num_iterations,
                use_vllm=self.use_vllm, vllm_importance_sampling_correction=self.vllm_importance_sampling_correction,
            ):
                return ForwardCall("trl_old", model, measure=True)
        return ForwardCall("ref", model)

    # ------------------------------------------------------------------ scoring
    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring inside the features' ``generation`` hooks, then ``on_batch``, the mode's
        ``score`` and ``after_score`` (``docs/explanation/architecture.md`` lists the keys each adds; with no
        correction
        configured nothing of TRL's is changed)."""
        gen = self._gen = GenerationBatch(started=time.time())
        features = self.rollout_corr_features
        try:
            with features.around("generation", self, gen):
                batch = super()._generate_and_score_completions(inputs)
            if gen.trl_old_skipped:
                batch.pop("old_per_token_logps")  # TRL's placeholder: pi_old comes later (or is mu)
            features.before("on_batch", self, gen, batch)
            self.rollout_corr_mode.score(self, gen, batch)
            features.after("after_score", self, gen, batch)
        finally:
            self._gen = None
        return batch

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        """The mode's loss (``modes/``) between the features' ``before_loss`` and ``after_loss`` (``LossStep``)."""
        step = self._loss = LossStep(original=inputs, inputs=inputs)
        try:
            self.rollout_corr_mode.prepare_loss(self, model, step)
            self.rollout_corr_features.before("before_loss", self, step)
            loss = self.rollout_corr_mode.loss(self, model, step, super()._compute_loss)
        finally:
            self._loss = None
        self.rollout_corr_features.after("after_loss", self, step)
        return loss

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Adds the exact ``rollout_corr/*`` values of everything since the previous call, then TRL's ``log``.

        Runs on every rank (the Trainer calls ``log`` on all processes), so the cross-rank reduction is safe.
        """
        logs.update(self.rollout_corr_metrics.flush(self.metrics_mode))  # in place: evaluate() returns this dict
        self.rollout_corr_features.before("on_log", self, logs)
        super().log(logs, start_time)
        self.rollout_corr_features.after("after_log", self, self.state.log_history[-1])

    # ------------------------------------------------------------------ checkpoints on the Hub
    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer's checkpoint push (``push_to_hub``), with every rank's feature-state file already in the folder:
        transformers pushes before the callbacks' ``on_save`` (``checkpoint_state.save_before_push``)."""
        checkpoint_state.save_before_push(self, checkpoint_folder)
        super()._push_from_checkpoint(checkpoint_folder)

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

    # ------------------------------------------------------------------ services for the modes and features
    @property
    def metrics_mode(self) -> str:
        """``"train"`` or ``"eval"``, as TRL decides it (from the policy's training flag)."""
        return "train" if self.model.training else "eval"

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning once per trainer."""
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("RolloutCorrGRPOTrainer: %s.", message)

    def trl_metric(self, name: str, value: float) -> None:
        """Append ``value`` to TRL's own metric ``name`` (logged, averaged, at TRL's next ``log``)."""
        self._metrics[self.metrics_mode][name].append(value)

    def policy_forward(self, call: ForwardCall, fwd: trl_compat.ForwardInputs, **kwargs):
        """One of our own log-prob forwards, with its role (``call``): TRL's forward of ``call.model`` over ``fwd``
        (``trl_compat.prompt_completion_inputs``) with exactly ``kwargs`` (``batch_size``, multimodal keys: the row
        chunking changes float results), seen by the features' ``forward`` hooks. Returns TRL's
        ``(log_probs (B, T), entropies, aux_loss)``."""
        self._forward_call = call
        return self._get_per_token_logps_and_entropies(call.model, fwd.input_ids, fwd.attention_mask,
                                                       fwd.logits_to_keep, **kwargs)

    def old_log_probs(self, batch: dict) -> torch.Tensor:
        """pi_old: one no-grad forward of the policy over the local generation batch (role ``old``: routes replayed
        and their mismatch measured with routing replay on, support-scored when matching). Returns (B, T) float32."""
        fwd = trl_compat.prompt_completion_inputs(batch)
        train = self.metrics_mode == "train"
        batch_size = self.args.per_device_train_batch_size if train else self.args.per_device_eval_batch_size
        self.rollout_corr_forward_counts["old_log_probs"] += 1
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self.policy_forward(ForwardCall("old", self.model, batch=batch, measure=True), fwd,
                                            batch_size=batch_size, **fwd.multimodal)
        return old.float()

    def step_micro_batches(self) -> list:
        """The micro-batches of the optimizer step now starting: TRL's buffered ``_buffered_inputs[(k + i) %
        steps_per_generation]`` for its micro-steps ``k + i``, i < ``current_gradient_accumulation_steps``.

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
        return [self._buffered_inputs[(self._step + i) % spg] for i in range(accumulation)]

