"""Rollout records (``rollout_dump_dir``; ``records/``, spec 10): the writer's lifecycle in the trainer.

Five hooks and a callback, training only: ``__init__`` opens the writer, writes ``run.json`` once and adds a
``TrainerCallback`` whose ``on_save`` hands each checkpoint to the writer (``save_open_window``: the rows of a window
still open at the checkpoint, so a run resumed from it continues the window exactly); ``on_batch`` tags each
generated row (row index, batch index, local rewards, generation times), which TRL's shuffle and split carry to the
loss; ``after_score`` adds the support scores of the batch's pi_old forward (``GenerationBatch.support``, matching
on) the same way; ``after_loss`` hands each trained micro-batch (as TRL passed it: ``LossStep.original``) and its
pi_theta (``LossStep.policy_log_probs``) to the writer; ``after_log`` closes the window of the logged step, after TRL's
``log`` added its own values (the Trainer's copy in ``log_history``, which callbacks cannot change).

Its state at a checkpoint (``state_dict``: the generation batches tagged and the writer's counts) is saved with the
checkpoint's other feature state (``checkpoint_state``); a resumed run numbers on from it.

Last in ``features.FEATURES``: nothing is written before every other part accepted the setup.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ..correction import DEFAULT_LENGTH_BUCKETS
from ..hooks import Feature, GenerationBatch, LossStep, refuse_config
from ..model_card import rollout_engine_record  # the one description of the engine (card, records, summary)

if TYPE_CHECKING:
    from ..records import MicroBatch, RolloutRecordWriter
    from ..trainer import RolloutCorrGRPOTrainer

# GRPOConfig fields recorded in run.json: what shapes the batches, the windows and the loss.
RECORDED_TRAINER_FIELDS = (
    "loss_type", "beta", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "num_iterations", "logging_steps", "max_steps", "learning_rate", "seed", "bf16",
    "mask_truncated_completions", "scale_rewards", "epsilon", "epsilon_high", "importance_sampling_level",
    "rollout_support_matching", "routing_replay", "max_policy_lag", "policy_lag_split",
)


class RolloutRecords(Feature):
    """The ``records.RolloutRecordWriter`` of ``rollout_dump_dir`` (module docstring).

    Attributes:
        writer: the writer (``run.json`` already written).

    Raises:
        records.RecordsError: a folder that already holds a dump (from the writer).
    """

    name = "rollout_records"

    @classmethod
    def wanted(cls, args) -> bool:
        return args.rollout_dump_dir is not None

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``rollout_dump_every``: an int >= 1, other than 1 only with ``rollout_dump_dir``."""
        if not isinstance(args.rollout_dump_every, int) or args.rollout_dump_every < 1:
            refuse_config(f"rollout_dump_every must be an integer >= 1, got {args.rollout_dump_every!r}.")
        if args.rollout_dump_every != 1 and args.rollout_dump_dir is None:
            refuse_config(f"rollout_dump_every={args.rollout_dump_every} keeps one logged window in N of the rollout "
                          "records, but rollout_dump_dir is unset (no records are written), so it would be ignored: "
                          "set rollout_dump_dir, or unset rollout_dump_every.")

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        from .. import records

        args = trainer.args
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        self.writer: RolloutRecordWriter = records.RolloutRecordWriter(
            args.rollout_dump_dir, rank=trainer.accelerator.process_index,
            world_size=trainer.accelerator.num_processes, is_main_process=trainer.accelerator.is_main_process,
            every=args.rollout_dump_every, eos_token_ids=trainer.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id, max_completion_length=trainer.max_completion_length,
        )
        self.batches = 0  # generation batches tagged on this rank
        self.num_experts = None  # E of the MoE layers with routing replay (the routes' packing), else None
        if args.routing_replay == "r3":
            from ..routing import find_moe_routers

            self.num_experts = find_moe_routers(unwrapped).num_experts
        correction = trainer.rollout_correction
        self.writer.write_run_metadata(records.run_metadata(
            model=unwrapped, tokenizer=trainer.processing_class,
            engine=rollout_engine_record(trainer), sampling=dict(
                temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
                repetition_penalty=trainer.repetition_penalty, max_completion_length=trainer.max_completion_length,
                generation_kwargs=args.generation_kwargs, use_vllm=trainer.use_vllm,
                generation_config=generation_config_dict(unwrapped),
            ),
            correction=correction, correction_extra=dict(
                mode=trainer.rollout_corr_mode.name,  # "diagnostics" (no correction), "decoupled", "bypass"
                rollout_corr_preset=args.rollout_corr_preset, length_buckets=list(DEFAULT_LENGTH_BUCKETS),
                rs_keep_rejected_in_baseline=args.rs_keep_rejected_in_baseline,
            ),
            trainer={name: getattr(args, name, None) for name in RECORDED_TRAINER_FIELDS},
            rewards=dict(names=list(trainer.reward_func_names), weights=trainer.reward_weights.tolist()),
        ))
        trainer.add_callback(_save_open_window_callback(self.writer))

    def on_batch(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """Per-row fields the records need that TRL does not carry to the loss: (B,) row index, 0-d batch index,
        (B, F) local rewards, (B, 2) float64 generation times (unix seconds: start, now)."""
        if trainer.metrics_mode != "train":
            return
        rows = batch["completion_ids"].size(0)
        device = batch["completion_ids"].device
        batch["rollout_record_row"] = torch.arange(rows, device=device)
        batch["rollout_record_batch"] = torch.tensor(self.batches)
        self.batches += 1
        if gen.rewards is not None:
            start = trainer.accelerator.process_index * rows
            batch["rollout_record_rewards"] = gen.rewards[start:start + rows].float()
        batch["rollout_record_times"] = torch.tensor([[gen.started, time.time()]], dtype=torch.float64).expand(rows, 2)

    def after_score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """Matching on: the (B, T) log S, |K| and misses of the batch's measured pi_old forward
        (``GenerationBatch.support``) into ``rollout_record_support_{log_mass,size,miss}``, carried with the rows to
        the loss like the keys of ``on_batch``."""
        if gen.support is not None:
            _support_keys(batch, gen.support)

    def after_loss(self, trainer, step: LossStep) -> None:
        """The trained micro-batch, as TRL passed it, and its pi_theta to the writer (training only; without a
        correction a batch can lack mu: warned, no diagnostics, not recorded). A measured forward of the loss step
        (``LossStep.support``: pi_old read from it, the bypass loss) gives the support columns, written to the
        micro-batch TRL holds (later iterations over it find pi_old's) and to what the mode trained on when that is a
        copy (``PolicyLag``'s lag filter: ``micro_batch`` reads it first)."""
        if step.support is not None:
            _support_keys(step.original, step.support)
            if step.inputs is not step.original:
                _support_keys(step.inputs, step.support)
        if trainer.metrics_mode == "train" and "rollout_log_probs" in step.original:
            self.writer.add(micro_batch(trainer.state.global_step, step.original, step.policy_log_probs,
                                        trained=step.inputs, num_experts=self.num_experts))

    def after_log(self, trainer, record: Mapping[str, Any]) -> None:
        """Close the logged step's window with TRL's logged values (training only)."""
        if trainer.metrics_mode == "train":
            self.writer.end_window(trainer.state.global_step, record)

    def state_dict(self) -> dict:
        """This rank's counts at the checkpoint: generation batches tagged (``batches``) and the writer's
        (``RolloutRecordWriter.state_dict``: windows, micro-batches, bytes and rows written). The rows of a window
        still open at the checkpoint are in the dump (``open-window/``, written by this feature's ``on_save``)."""
        return {"batches": self.batches, "writer": self.writer.state_dict()}

    def load_state_dict(self, state) -> None:
        """Continue ``state_dict()``'s counts: the resumed run's generation batches and micro-batches are numbered
        on from the checkpoint's, as the uninterrupted run's are (also across windows ``rollout_dump_every`` skips)."""
        self.batches = int(state["batches"])
        self.writer.load_state_dict(state["writer"])


def _support_keys(batch: dict, score) -> None:
    """``batch["rollout_record_support_{log_mass,size,miss}"]``: (B, T) of a ``support.SupportScore``."""
    for name in ("log_mass", "size", "miss"):
        batch[f"rollout_record_support_{name}"] = getattr(score, name)


def _save_open_window_callback(writer: "RolloutRecordWriter"):
    """A ``TrainerCallback`` whose ``on_save`` (every rank, after the Trainer wrote ``checkpoint-<global_step>``)
    calls ``writer.save_open_window(global_step)``."""
    from transformers import TrainerCallback

    class SaveOpenWindow(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            writer.save_open_window(state.global_step)

    return SaveOpenWindow()


def micro_batch(step: int, inputs: dict, log_probs: Optional[torch.Tensor], *, trained: Optional[dict] = None,
                num_experts: Optional[int] = None) -> "MicroBatch":
    """The ``records.MicroBatch`` of one trained micro-batch (TRL's keys mapped to record column names).

    Args:
        step: learner step at use. inputs: the micro-batch as TRL passed it (``LossStep.original``).
        log_probs: (B, T) pi_theta of its loss forward. trained: what the mode trained on (``LossStep.inputs``;
            the support columns are read from it first, then from ``inputs``: ``RolloutRecords`` writes them there
            from the pi_old forward's or the loss step's measured forward's score). num_experts: E, with routing
            replay.
    """
    from ..records import MicroBatch

    support = {}
    for name in ("support_log_mass", "support_size", "support_miss"):
        key = f"rollout_record_{name}"
        support[name] = (trained or {}).get(key, inputs.get(key))
    if support["support_miss"] is None and inputs.get("rollout_support_miss") is not None:
        support["support_miss"] = inputs["rollout_support_miss"]

    return MicroBatch(
        step=step, generation_step=int(inputs["rollout_generation_step"]),
        generation_batch=int(inputs["rollout_record_batch"]),
        prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"],
        completion_ids=inputs["completion_ids"], completion_mask=inputs["completion_mask"],
        rollout_log_probs=inputs["rollout_log_probs"], advantages=inputs["advantages"],
        generation_row=inputs["rollout_record_row"], rewards=inputs.get("rollout_record_rewards"),
        times=inputs.get("rollout_record_times"),
        policy_version=inputs.get("rollout_policy_version"),
        per_token=dict(
            tool_mask=inputs.get("tool_mask"),
            old_log_probs=inputs.get("old_per_token_logps", inputs.get("rollout_old_log_probs")),
            log_probs=log_probs, ref_log_probs=inputs.get("ref_per_token_logps"),
            rollout_is_weights=inputs.get("rollout_is_weights"), rollout_rs_mask=inputs.get("rollout_rs_mask"),
            version_log_probs=inputs.get("rollout_version_log_probs"),
            policy_version_tokens=inputs.get("rollout_policy_version_tokens"), **support,
        ),
        routes=inputs.get("routed_experts") if num_experts is not None else None, num_experts=num_experts,
    )


def generation_config_dict(model) -> Optional[dict]:
    """The model's generation config, as the differences from transformers' defaults (what generate falls back to)."""
    config = getattr(model, "generation_config", None)
    return None if config is None else config.to_diff_dict()
