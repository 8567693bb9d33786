"""The Trainer state the trainer reads or wraps: TRL 1.16's micro-step counter and generation cadence, transformers
5.x's optimizer step and resumed-epoch skip, and TRL's prompt tokenisation for a generation batch (asynchronous
generation, issue 45; empty steps), and its checkpoint folder and ``resume_from_checkpoint`` resolution (the
features' checkpoint state, ``checkpoint_state``; the model, optimizer and ``TrainerState`` are loaded before
``on_train_begin``).

Pinned in ``tests/trainer/test_trl_compat.py`` and ``tests/features/test_async_pipeline.py``.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


def wrap_optimizer_step(optimizer: Any, allow: Callable[[], bool]) -> None:
    """Make ``optimizer.step()`` a no-op whenever ``allow()`` returns False (``features.empty_steps``).

    The Trainer (transformers 5.x, ``_run_epoch``) calls ``self.optimizer.step()`` once per optimizer
    step, on the optimizer ``accelerator.prepare`` returned (pinned in ``tests/trainer/test_trl_compat.py``); the
    wrapper is set on that instance once (``_rollout_corr_step_wrapped``), and ``allow`` runs on every call (it may run
    a collective: every rank calls ``step``).

    Args:
        optimizer: the prepared optimizer (``trainer.optimizer``).
        allow: called at each ``step``; False skips the step.
    """
    if getattr(optimizer, "_rollout_corr_step_wrapped", False):
        return
    step = optimizer.step

    def maybe_step(*args, **kwargs):
        if allow():
            return step(*args, **kwargs)
        return None

    optimizer.step = maybe_step
    optimizer._rollout_corr_step_wrapped = True


def generate_every(args: Any, num_iterations: int) -> int:
    """Micro-steps between two generations in training: TRL 1.16's ``_prepare_inputs`` regenerates when ``_step %
    (steps_per_generation * num_iterations) == 0``; its ``RepeatSampler`` yields each generation batch that many
    times in a row (``repeat_count``), one dataloader item per micro-step."""
    return int(args.steps_per_generation) * int(num_iterations)


def first_optimizer_step(batch: int, every: int, gradient_accumulation_steps: int,
                         steps_in_epoch: Optional[int] = None) -> int:
    """The optimizer step (``state.global_step``) during which TRL generates generation batch ``batch``: its first
    micro-step is ``batch * every`` and ``global_step`` advances every ``gradient_accumulation_steps`` micro-steps,
    and (transformers 5.x's ``_inner_training_loop``) once more at the end of an epoch whose ``steps_in_epoch``
    micro-steps leave a remainder: an epoch has ``ceil(steps_in_epoch / gradient_accumulation_steps)`` optimizer
    steps. ``steps_in_epoch`` None: one epoch (no boundary)."""
    micro, accumulation = int(batch) * int(every), int(gradient_accumulation_steps)
    if not steps_in_epoch:
        return micro // accumulation
    epoch, within = divmod(micro, int(steps_in_epoch))
    return epoch * -(-int(steps_in_epoch) // accumulation) + within // accumulation


def micro_steps_at(step: int, gradient_accumulation_steps: int, steps_in_epoch: Optional[int] = None) -> int:
    """The micro-steps (dataloader items, counted over epochs) transformers 5.x's ``_run_epoch`` has consumed when
    ``state.global_step`` reaches ``step``: an epoch of ``steps_in_epoch`` items has ``ceil(steps_in_epoch /
    gradient_accumulation_steps)`` optimizer steps, each of ``gradient_accumulation_steps`` items but the epoch's
    last (the remainder); ``steps_in_epoch`` None: one epoch (no boundary). The inverse of
    ``first_optimizer_step`` at step starts: where a resume at ``step`` continues, and (``step = state.max_steps``,
    where its ``DefaultFlowCallback`` stops training) how many items a run trains.

    Raises:
        ValueError: ``step < 0`` or ``gradient_accumulation_steps < 1``.
    """
    step, accumulation = int(step), int(gradient_accumulation_steps)
    if step < 0 or accumulation < 1:
        raise ValueError(f"micro_steps_at needs step >= 0 and gradient_accumulation_steps >= 1, got {step}, "
                         f"{accumulation}.")
    if not steps_in_epoch:
        return step * accumulation
    epoch, within = divmod(step, -(-int(steps_in_epoch) // accumulation))
    return epoch * int(steps_in_epoch) + within * accumulation


def micro_steps_trained(start_step: int, max_steps: Optional[int], gradient_accumulation_steps: int,
                        steps_in_epoch: Optional[int] = None) -> Optional[int]:
    """The micro-steps (dataloader items from the run's start, over epochs) transformers 5.x has consumed when a
    ``train`` started or resumed at optimizer step ``start_step`` stops at ``max_steps`` (``state.max_steps``, set
    before ``on_train_begin``, also from ``num_train_epochs``): ``DefaultFlowCallback.on_step_end`` stops training
    once ``global_step >= max_steps``, checked after a step, so a run resumed at or past ``max_steps`` inside an
    epoch still trains one step (counted: the bound is never short). ``max_steps`` None or <= 0: unknown, None.
    Fewer are consumed when a callback stops training early or an iterable dataset yields nothing (a finite one is
    iterated again each epoch: ``num_train_epochs = sys.maxsize``)."""
    if max_steps is None or int(max_steps) <= 0:
        return None
    last = max(int(max_steps), int(start_step) + 1)
    return micro_steps_at(last, gradient_accumulation_steps, steps_in_epoch)


def micro_step(trainer: Any) -> int:
    """TRL's micro-step counter ``GRPOTrainer._step`` (incremented in ``training_step``; 0 in a fresh trainer, so on
    resume it counts from the resumed step)."""
    return trainer._step


@contextlib.contextmanager
def loader_skips_itself(loader_type: type) -> Iterator[None]:
    """Within the block, transformers 5.x's ``Trainer._run_epoch`` skips a resumed epoch's trained batches
    (``skip_first_batches(train_dataloader, n)``, accelerate's function imported into ``transformers.trainer``)
    through ``loader.skip_first(n, skip_first_batches)`` when the loader is a ``loader_type``: accelerate's function
    rebuilds a plain DataLoader from the loader's attributes, which would drop a wrapper (``LookAheadLoader``)."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches
    hf_trainer.skip_first_batches = lambda loader, n=0: (
        loader.skip_first(n, original) if isinstance(loader, loader_type) else original(loader, n))
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


def generation_prompt_ids(trainer: Any, items: list) -> list:
    """The prompt token ids TRL 1.16 generates for a generation batch's dataloader items:
    ``_generate_and_score_completions`` takes ``[x["prompt"] for x in inputs]`` and ``_generate`` tokenises a deep
    copy with ``_tokenize_prompts`` (no rollout_func, no environments). Returns one list of ints per row."""
    prompts = copy.deepcopy([x["prompt"] for x in items])
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    return [list(ids) for ids in prompt_ids]


def checkpoint_folder(args, step: int) -> Path:
    """The folder transformers 5.x's ``Trainer._save_checkpoint`` writes at optimizer step ``step``, before the
    callbacks' ``on_save`` (on every rank): ``<output_dir>/checkpoint-<step>`` (no hyperparameter search)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{int(step)}"


def pushes_checkpoints(args) -> bool:
    """Whether transformers 5.x's ``Trainer._save_checkpoint`` pushes each checkpoint to the Hub: it calls
    ``_push_from_checkpoint(<checkpoint folder>)`` on every rank after writing the folder and before the callbacks'
    ``on_save``, when ``push_to_hub``; that method returns at once with ``hub_strategy="end"`` (and on every rank
    but the main one), else uploads (``every_save``: the model files; ``checkpoint`` / ``all_checkpoints``: also the
    checkpoint folder)."""
    from transformers.trainer_utils import HubStrategy

    return bool(getattr(args, "push_to_hub", False)) and HubStrategy(args.hub_strategy) != HubStrategy.END


def resume_checkpoint(args, resume_from_checkpoint: Any) -> Optional[str]:
    """The checkpoint ``Trainer.train(resume_from_checkpoint=...)`` resumes from: ``True`` the latest under
    ``args.output_dir`` (None when there is none, or no such folder: the Trainer refuses that itself), a path that
    path, None / False none."""
    if isinstance(resume_from_checkpoint, bool):
        if not resume_from_checkpoint or not os.path.isdir(args.output_dir):
            return None
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(args.output_dir)
    return None if resume_from_checkpoint is None else str(resume_from_checkpoint)
