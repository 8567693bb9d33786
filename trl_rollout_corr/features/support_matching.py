"""Sampling-support matching (``rollout_support_matching``; ``support/``): the sampler contract, its start-up report
and, when matching, the support-scored policy forwards.

At start-up: the sampler contract (``rollout_sampler``: what the engine applies, from the config,
``generation_kwargs`` and the model's ``generation_config.json``, or a ``rollout_func``'s ``sampler_contract``) and a
report of every parameter that shapes mu but not the trainer's log-probs (``rollout_sampler_report``).

``"recompute"`` / ``"replay"``: the pi_old, pi_theta and pi_train@v forwards (roles ``trl_old``, ``old``, ``loss``,
``bypass_loss``, ``batch_norm_window``, ``version``) score over the engine's support, the missed tokens (sampled
outside it) come back as ``ForwardCall.miss`` / the batch key ``rollout_support_miss`` and are made invalid by the
mode (``version``: by ``LagSplit``),
``rollout_corr/support_*`` are logged for the forwards that measure. ``"off"`` with truncation: TRL's log-probs, the
kept mass measured once on the first training batch and reported in one warning at the next log.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from .. import support, trl_compat
from ..hooks import ROLE_TRAITS, Feature, ForwardCall, GenerationBatch, PlainGenerate, refuse_config

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

logger = logging.getLogger("trl_rollout_corr.trainer")  # the trainer's logger: its messages keep their source



class SupportMatching(Feature):
    """The sampler contract, support scoring and its statistics (module docstring); present in every trainer.

    Attributes:
        sampler: the ``support.SamplerSpec`` the engine samples with, or None (a ``rollout_func`` that declares none,
            or greedy / beam generation without a correction).
        report: the start-up report (one line per sampler parameter that shapes mu but not the trainer's
            log-probs).
        scorer: the ``support.SupportScorer`` when matching is on, else None.

    Raises:
        ValueError: matching requested where it cannot be delivered (each message names the fix): a
            ``rollout_func`` that declares no sampler, replay on a path that cannot return kept-token sets, a
            processor the trainer cannot reproduce, a model whose LM head rescales its logits, DeepSpeed ZeRO-3 or
            FSDP1 (FSDP2 is supported).
        RuntimeError: (generation) matching on and ``generate`` applied other processors than the contract's.
    """

    name = "support_matching"

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``rollout_support_matching``: one of ``support.MATCHING_MODES``; on, only with a configured correction, and
        in decoupled mode only where pi_old and the loss forward see the same policy."""
        matching = args.rollout_support_matching
        support.check_matching_mode(matching)
        if matching == "off":
            return
        if not correction.enabled:
            refuse_config(
                f"rollout_support_matching={matching!r} changes the log-probs the trainer "
                "trains on, but no correction is configured (TRL's GRPO runs unchanged then); configure one "
                "(rollout_is / rollout_rs / bypass_mode or a rollout_corr_preset) or set "
                "rollout_support_matching='off'."
            )
        reused = args.num_iterations > 1 or args.steps_per_generation != args.gradient_accumulation_steps
        if not correction.bypass_mode and reused:
            refuse_config(
                f"rollout_support_matching={matching!r} in decoupled mode scores pi_theta "
                "over its own recomputed support, which must be pi_old's: with num_iterations > 1 or "
                "steps_per_generation != gradient_accumulation_steps the policy changes between the pi_old and "
                "the loss forwards, and tokens outside pi_theta's support would be trained on uncounted. Use "
                "num_iterations=1 and steps_per_generation=gradient_accumulation_steps, bypass_mode=True (its "
                "missed tokens are made invalid), or rollout_support_matching='off'."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        matching = self.matching = trainer.args.rollout_support_matching
        self.scorer: Optional[support.SupportScorer] = None
        self.measure_due = self.warn_due = self.processors_warned = False
        self._kept: Optional[list] = None  # replay: the kept sets of the generation in progress
        self._trl_old_score: Optional[support.SupportScore] = None
        try:
            spec = self.sampler = sampler_contract(trainer)
        except ValueError:  # greedy or beam generation: no sampling distribution (TRL's, only without a correction)
            if matching != "off":
                raise
            self.sampler, self.report = None, []
            return
        self.report = [] if spec is None else spec.report(matching)
        # matching off with a reproducible truncation: measure log S once (first training batch), warn at the next log
        self.measure_due = self.warn_due = matching == "off" and spec is not None and bool(spec.set_steps)
        if spec is None:
            logger.warning("Sampler contract unknown: the rollout_func declares no sampler_contract(trainer), so the "
                           "sampling parameters that shape mu cannot be checked against the trainer's log-probs.")
        else:
            logger.info("Sampler contract: %s (rollout_support_matching=%r).", spec.describe(), matching)
        if self.report:
            logger.warning("Sampler contract (rollout_support_matching=%r):\n  - %s%s", matching,
                           "\n  - ".join(self.report),
                           "\nSet rollout_support_matching='recompute' to score with the engine's processors."
                           if matching == "off" else "")
        if matching == "off":
            return
        check_deliverable(trainer, spec, matching)
        if spec.matches_trl_scoring:
            logger.warning(
                "rollout_support_matching=%r changes nothing here: the engine truncates nothing and applies nothing "
                "that TRL's log-probs do not (%s), so the support-scored log-probs equal TRL's and only cost the "
                "support scorer in every policy forward. Set rollout_support_matching='off', or set the top_p / "
                "top_k / min_p the engine samples with (GRPOConfig or generation_kwargs).", matching, spec.describe())
        self.scorer = support.SupportScorer(spec, matching)

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def generation(self, trainer, gen: GenerationBatch) -> Iterator[None]:
        """Replay: the generate capture also records the completions' kept-token sets (``gen.record_kept_sets``)."""
        self._kept, self._trl_old_score = None, None
        gen.record_kept_sets = self.matching == "replay"
        yield

    def after_plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> None:
        """The processors ``generate`` applied must be the contract's (matching on: an error; off: a warning, once);
        replay: keep the rows' kept sets (one ``support.KeptTokens`` per row)."""
        if call.capture is None:  # this generate yields no mu (BehaviourLogProbs): nothing was captured
            return
        self._check_engine_processors(call.capture.processors[0])
        if gen.record_kept_sets:
            self._kept = call.capture.completion_kept_tokens(call.completion_ids)

    def _check_engine_processors(self, processors: list) -> None:
        if self.sampler is None:  # greedy / beam generation without a correction: nothing to compare
            return
        problems = support.check_transformers_processors(self.sampler, processors)
        if not problems:
            return
        message = "; ".join(problems)
        if self.scorer is not None:
            raise RuntimeError(f"Support matching: {message}. The trainer would score with other processors than "
                               "the engine's; report this with the generation config.")
        if not self.processors_warned:
            self.processors_warned = True
            logger.warning("Sampler contract: %s.", message)

    def on_batch(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """Replay: ``batch["rollout_support"]`` (B ``support.KeptTokens``); after TRL's own pi_old forward scored
        over the support: its statistics and missed tokens (``rollout_support_miss``, (B, T) bool)."""
        if gen.record_kept_sets:
            batch["rollout_support"] = self._kept
        score, self._trl_old_score = self._trl_old_score, None
        if score is not None:
            self._record(trainer, batch, score, miss_key=True)

    # ------------------------------------------------------------------ forwards
    def _wanted(self, trainer, call: ForwardCall) -> bool:
        """Matching on: every policy forward of a scored role (``hooks.ForwardRole.scored``; ``version``, the lag
        split's pi_train@v, is compared with mu and pi_old, so scored over the same support); off: the forwards that
        measure, while the one-time measurement of the kept mass is due (training only)."""
        if not ROLE_TRAITS[call.role].scored:
            return False
        return self.scorer is not None or (call.measure and self.measure_due and trainer.metrics_mode == "train")

    @contextlib.contextmanager
    def forward(self, trainer, call: ForwardCall) -> Iterator[None]:
        """TRL's log-prob forward with the completion tokens also scored over the sampling support.

        A forward hook on the policy's backbone (``trl_compat.lm_head_input``: the module whose last hidden state
        TRL's fused LM head scores) runs ``support.SupportScorer`` on each row chunk TRL forwards, over the completion
        positions only. Matching on, the support-matched log-probs replace TRL's in ``call.result`` and ``call.miss``
        holds the missed tokens; TRL's fused head does not run then (``trl_compat.skip_fused_lm_head``: its output
        would be thrown away), and the entropies, when the call wants them, come from the scorer's logits (full
        vocabulary at ``GRPOConfig.temperature``, what TRL's head computes; detached, as TRL's GRPO loss never
        differentiates them).
        """
        if not self._wanted(trainer, call):
            yield
            return
        replace = self.scorer is not None
        backbone, head = trl_compat.lm_head_input(trainer.accelerator.unwrap_model(call.model))
        scorer = self.scorer or support.SupportScorer(self.sampler, "recompute")
        kept = self._kept if call.role == "trl_old" else call.batch.get("rollout_support")
        done = [0]
        entropy_t = trainer.temperature if replace and call.compute_entropy else None

        def score(_args, chunk_kwargs, output):
            ids, mask = chunk_kwargs["input_ids"], chunk_kwargs["attention_mask"]
            rows = None if kept is None else kept[done[0]:done[0] + ids.size(0)]
            done[0] += ids.size(0)
            grad = contextlib.nullcontext() if replace else torch.no_grad()
            with grad, torch.autocast(ids.device.type, enabled=False):
                return scorer.score(output.last_hidden_state, head.weight, head.bias, ids, mask, call.logits_to_keep,
                                    rows, entropy_temperature=entropy_t)

        with (support.capture_module_outputs(backbone, score) as scores,
              trl_compat.skip_fused_lm_head() if replace else contextlib.nullcontext()):
            yield
        logps, entropies, aux_loss = call.result
        if done[0] != logps.size(0):
            raise RuntimeError(f"Support matching scored {done[0]} rows of a {logps.size(0)}-row forward: the "
                               "policy's backbone was not called once per row chunk (unsupported model wrapper?).")
        matched = support.SupportScore.cat(scores)
        if replace:
            entropies = matched.entropy if entropy_t is not None else entropies
            call.result, call.miss, call.support = (matched.log_probs, entropies, aux_loss), matched.miss, matched
        if call.role == "trl_old":  # its batch does not exist yet: recorded in on_batch
            self._trl_old_score = matched
        elif call.measure:
            self._record(trainer, call.batch, matched, miss_key=call.role == "old")

    def _record(self, trainer, batch: dict, matched: support.SupportScore, *, miss_key: bool) -> None:
        """A measured forward's ``rollout_corr/support_*`` statistics over the batch's loss mask; ``miss_key``:
        matching on, its missed tokens go to ``batch["rollout_support_miss"]`` (made invalid by the mode's
        correction). The score itself travels on the per-call objects (``ForwardCall.support``)."""
        trainer.rollout_corr_metrics.add_support(trainer.metrics_mode,
                                                 support.SupportStats.from_score(matched, trl_compat.loss_mask(batch)))
        self.measure_due = False
        if miss_key and self.scorer is not None:
            batch["rollout_support_miss"] = matched.miss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The one-time events already done: the kept-mass measurement (``measure_due``), its warning
        (``warn_due``) and the processors warning (``processors_warned``): a resumed run neither measures nor warns
        again (its logged keys are the uninterrupted run's)."""
        return {"measure_due": self.measure_due, "warn_due": self.warn_due,
                "processors_warned": self.processors_warned}

    def load_state_dict(self, state) -> None:
        """Restore ``state_dict()``'s flags (a one-time event stays done; one not due in this run stays not due)."""
        self.measure_due = self.measure_due and bool(state["measure_due"])
        self.warn_due = self.warn_due and bool(state["warn_due"])
        self.processors_warned = bool(state["processors_warned"])

    # ------------------------------------------------------------------ logging
    def on_log(self, trainer, logs: dict) -> None:
        """Matching off, truncation on: one warning with the measured mean log kept mass (first logged step)."""
        log_mass = logs.get(f"{support.PREFIX}support_log_mass_mean")
        if not self.warn_due or log_mass is None:
            return
        self.warn_due = False
        names = ", ".join(str(p) for p in self.sampler.set_steps)
        logger.warning(
            "Sampling support: the engine truncates (%s) but the trainer scores the full vocabulary "
            "(rollout_support_matching='off'). Measured mean log kept mass %.4f nats per token: every engine ratio "
            "pi_train / mu sits near %.3f from the support alone, a bias that IS/RS read as mismatch. Set "
            "rollout_support_matching='recompute' to score with the engine's support.", names, log_mass,
            math.exp(log_mass))


def sampler_contract(trainer) -> Optional[support.SamplerSpec]:
    """What the rollout engine samples with: a ``rollout_func``'s own ``sampler_contract(trainer)``, TRL's vLLM
    ``SamplingParams``, or the generation config ``transformers.generate`` resolves (TRL's config, then
    ``generation_kwargs``, then the model's ``generation_config.json``). None: a ``rollout_func`` without one.

    Raises:
        ValueError: greedy or beam generation (no sampling distribution; from ``support``).
    """
    if trainer.rollout_func is not None:
        contract = getattr(trainer.rollout_func, "sampler_contract", None)
        return None if contract is None else contract(trainer)
    generation_kwargs = trainer.args.generation_kwargs
    sources = trl_compat.sampler_sources(trainer.args, generation_kwargs)
    if trainer.use_vllm:
        params = trl_compat.vllm_sampling_kwargs(
            temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
            repetition_penalty=trainer.repetition_penalty, max_tokens=trainer.max_completion_length,
            generation_kwargs=generation_kwargs,
        )
        return support.sampler_from_vllm_params(params, sources=sources, trainer_temperature=trainer.temperature)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    config = trl_compat.resolved_generation_config(unwrapped, trainer.generation_config).to_dict()
    return support.sampler_from_generation_config(config, sources=sources, trainer_temperature=trainer.temperature)


def check_deliverable(trainer, spec: Optional[support.SamplerSpec], matching: str) -> None:
    """Refuse ``rollout_support_matching`` where it cannot be delivered (the class's Raises, ValueError)."""
    def fail(msg: str) -> None:
        raise ValueError(f"rollout_support_matching={matching!r}: {msg}")

    if spec is None:
        fail("the rollout_func declares no sampler, so the trainer cannot know the engine's processors; give it "
             "a sampler_contract(trainer) method returning a support.SamplerSpec (as "
             "engines.vllm_cpu_rollout.VLLMCPURollout does), or set rollout_support_matching='off'.")
    if matching == "replay" and (trainer.use_vllm or trainer.rollout_func is not None):
        fail("this generation path cannot return the engine's kept-token sets (vLLM 0.32 returns them only with "
             "return_sampling_mask=True on Model Runner V2, which TRL's vLLM paths and the CPU build do not "
             "offer); use rollout_support_matching='recompute', or the transformers.generate path for replay.")
    if matching == "replay" and trainer.tools:
        fail("tool calling generates each completion in several generate() calls, whose kept sets this trainer "
             "does not stitch; use rollout_support_matching='recompute'.")
    spec.check(matching)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    transforms = trl_compat.unsupported_logit_transforms(unwrapped)
    if transforms:
        fail(f"the model's LM head rescales its logits ({', '.join(transforms)}), which support matching does "
             "not reproduce; set rollout_support_matching='off'.")
    backend = trl_compat.sharded_backend(trainer.accelerator)
    if backend in ("DeepSpeed ZeRO-3", "FSDP1"):
        fail(f"the support computation reads the LM head's weight in a hook on the backbone, outside the head's "
             f"own forward, and saves it for the backward; {backend} holds only this rank's shard of it there "
             "(an empty tensor by the backward). Use FSDP2 (fsdp_version: 2, where the hook sees the whole "
             "weight: tested to match 1 rank), DDP or ZeRO-1/2, or rollout_support_matching='off'.")
