"""The features' resume state in the checkpoint: every ``hooks.Feature.state_dict`` saved with each checkpoint,
restored when training resumes from it (the one checkpoint mechanism of the features).

Every rank writes ``rollout_corr_features.rank-<r>.pt`` (``torch.save``) into ``checkpoint-<global_step>`` when the
Trainer has saved it (``on_save``; with ``push_to_hub``, before the Trainer pushes the checkpoint,
``save_before_push``, so the pushed checkpoint holds it too): the state is per rank (the rollout records' counters,
the lag split's kept weights or this rank's shards of them), so each rank reads back its own file. The file holds
``{"format", "global_step", "rank", "world_size", "features": [names in FEATURES order], "state": {name:
state_dict}}``.

A run resumed from a checkpoint (``RolloutCorrGRPOTrainer.train(resume_from_checkpoint=...)``, resolved as the Trainer
resolves it: ``trl_compat.resume_checkpoint``) restores every feature's state at ``on_train_begin``: after the
Trainer loaded the model, the optimizer and ``TrainerState``, before the first step. It refuses, naming the fix, a
file of another step or format; a checkpoint without the file (plain TRL's, an older version's), of other features
than the run's, saved by another number of processes or holding the files of some ranks only starts the features
concerned fresh, on every rank alike, with one warning (``load``). So does a checkpoint transformers writes on
SIGTERM (``enable_jit_checkpoint``: it calls ``_save_checkpoint`` with no ``on_save``, possibly inside a step), which
holds no feature state.

The coupling to transformers' Trainer (the checkpoint folder, the resolution of ``resume_from_checkpoint``, the
order of saving, loading and the callbacks) is in ``trl_compat.trainer_state``, pinned in
``tests/trainer/test_trl_compat.py``. Hyperparameter search (a trial's own output folder) is not supported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from . import trl_compat
from .hooks import Feature

if TYPE_CHECKING:
    from .trainer import RolloutCorrGRPOTrainer

logger = logging.getLogger(__name__)

FORMAT = 1
FILE = "rollout_corr_features.rank-{rank:05d}.pt"
# the config fields that add or remove a feature (named in the refusal of a checkpoint of other features)
FEATURE_FIELDS = "policy_lag_split, routing_replay, skip_empty_steps, rollout_dump_dir"


def state_file(folder: os.PathLike | str, rank: int) -> Path:
    """This rank's feature-state file in checkpoint ``folder``."""
    return Path(folder) / FILE.format(rank=int(rank))


def save(trainer: "RolloutCorrGRPOTrainer", folder: os.PathLike | str) -> Path:
    """Write this rank's file of every feature's ``state_dict()`` into checkpoint ``folder`` (through a temporary
    file). Returns its path."""
    features = list(trainer.rollout_corr_features)
    payload = {"format": FORMAT, "global_step": int(trainer.state.global_step),
               "rank": int(trainer.accelerator.process_index), "world_size": int(trainer.accelerator.num_processes),
               "features": [f.name for f in features], "state": {f.name: f.state_dict() for f in features}}
    path = state_file(folder, payload["rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def save_before_push(trainer: "RolloutCorrGRPOTrainer", folder: os.PathLike | str) -> Optional[Path]:
    """Write this rank's file into checkpoint ``folder`` before the Trainer pushes it to the Hub, then wait for every
    rank (so the main process uploads every rank's file when the ranks share the folder: one node, or a shared
    filesystem), and remember it so that ``on_save`` does not write it a second time.

    With a disk per node (``save_on_each_node``) the main process uploads its own node's files only; a run resumed
    from that push finds the files of some ranks only and starts every feature fresh, with one warning (``load``).
    The Hub's ``last-checkpoint`` keeps files an earlier push left there: after a resume on fewer ranks, the extra
    ranks' older files stay, and resuming that snapshot on the old number of ranks is refused (``load``: a file of
    another step; delete those files).

    Why: transformers 5.x's ``_save_checkpoint`` calls ``_push_from_checkpoint`` on every rank BEFORE the callbacks'
    ``on_save``, and the main process uploads the folder then, in the background (``hub_strategy="checkpoint"``: as
    ``last-checkpoint``); a file written at ``on_save`` would miss that upload or race it, and a run resumed from the
    Hub's checkpoint would start every feature fresh. Called by ``RolloutCorrGRPOTrainer._push_from_checkpoint`` on
    every rank, before ``super()``; the coupling is ``trl_compat.pushes_checkpoints``, pinned in
    ``tests/trainer/test_trl_compat.py``.

    Returns the path written, or None when no checkpoint is pushed (``push_to_hub`` False, or
    ``hub_strategy="end"``): ``on_save`` then writes the file as always, and no rank waits.
    """
    if not trl_compat.pushes_checkpoints(trainer.args):
        return None
    path = save(trainer, folder)
    trainer.accelerator.wait_for_everyone()
    trainer.rollout_corr_state_saved = (str(Path(folder)), int(trainer.state.global_step))
    return path


def load(trainer: "RolloutCorrGRPOTrainer", folder: os.PathLike | str) -> list[str]:
    """Restore every feature's state from this rank's file in checkpoint ``folder``.

    A feature of this run with no saved state starts fresh (the neutral treatment of a checkpoint written by plain
    TRL's ``GRPOTrainer``, by an older ``trl_rollout_corr``, or by a run whose config had fewer features): support
    matching measures its kept mass again, the records recount the dump's files (``RolloutRecordWriter``), and the
    lag split holds only the resumed weights (it refuses, naming the fix, rows of an older version it does not hold).
    Saved state of a feature this run does not have is left unused. Every feature starts fresh on every rank when
    the checkpoint's state is per rank of another layout: saved by another number of processes (as plain TRL resumes
    there), or holding the files of some ranks only (copied from some nodes of a run without a shared filesystem).
    The decision is the same on every rank (one all-reduce before anything can raise), so no rank restores while
    another starts fresh (their features' collectives would then differ: a hang). One warning says what started
    fresh and why.

    Returns:
        The names of this run's features that started fresh (empty when every feature was restored).

    Raises:
        ValueError: on every rank, when some rank's file is of another format or step than the resumed
            ``TrainerState``'s (a file copied between checkpoints or versions; the message names the fix).
    """
    rank, world = int(trainer.accelerator.process_index), int(trainer.accelerator.num_processes)
    path = state_file(folder, rank)
    ours = [f.name for f in trainer.rollout_corr_features]
    payload = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
    step = int(trainer.state.global_step)
    wrong = payload is not None and (payload.get("format") != FORMAT or payload.get("global_step") != step)
    with_file, any_wrong = _on_every_rank(trainer, payload is not None, wrong)
    if any_wrong:
        raise ValueError(
            f"{folder}: a feature-state file ({FILE.replace('{rank:05d}', '<r>')}) of another format or step than "
            f"this run resumes at (step {step}, format {FORMAT}): a file copied between checkpoints or from another "
            "trl_rollout_corr version. Resume from the checkpoint folder the files were saved in, with the version "
            "that saved them, or delete the files to start the features fresh.")
    reason = None
    if with_file == 0:
        reason = f"it has no {path.name}"
    elif with_file < world:
        reason = f"{with_file} of {world} processes have their {FILE.replace('{rank:05d}', '<r>')}"
    elif payload.get("world_size") != world:
        reason = f"its feature state was saved by {payload.get('world_size')} processes, this run has {world}"
    saved = dict(payload["state"]) if payload is not None and reason is None else {}
    fresh = [name for name in ours if name not in saved]
    unused = [name for name, state in saved.items() if name not in ours and state]
    stateful = [f.name for f in trainer.rollout_corr_features if type(f).state_dict is not Feature.state_dict]
    if [name for name in fresh if name in stateful] or unused:
        where = reason or f"it was saved with the features {list(saved)}"
        logger.warning(
            "Resuming from %s: %s. These features of this run start fresh: %s; saved state left unused: %s (the "
            "features follow the config: %s). To continue every feature's state, resume on the checkpoint's number "
            "of processes with the checkpoint's settings of these fields.", folder, where,
            [n for n in fresh if n in stateful], unused, FEATURE_FIELDS)
    for feature in trainer.rollout_corr_features:
        if feature.name in saved:
            feature.load_state_dict(saved[feature.name])
    return fresh


def _on_every_rank(trainer: "RolloutCorrGRPOTrainer", has_file: bool, wrong: bool) -> tuple[int, bool]:
    """(ranks holding their file, whether any rank's file is of another format or step): one sum all-reduce
    (``rollout_corr_reducers``), so every rank decides alike; one process (or no reducers): every rank taken to be
    like this one."""
    reducers = getattr(trainer, "rollout_corr_reducers", None)
    if reducers is None or reducers.world_size <= 1:
        return int(trainer.accelerator.num_processes) if has_file else 0, bool(wrong)
    flags = torch.tensor([int(has_file), int(wrong)], dtype=torch.long,
                         device=getattr(trainer.accelerator, "device", None))
    total = reducers.sum(flags).cpu()
    return int(total[0]), bool(total[1])


def callback(trainer: "RolloutCorrGRPOTrainer"):
    """The ``TrainerCallback`` of the mechanism: ``on_save`` writes this rank's file into the checkpoint just saved
    (``trl_compat.checkpoint_folder``), ``on_train_begin`` restores it from ``trainer.rollout_corr_resume_from``
    (set by ``RolloutCorrGRPOTrainer.train``; consumed)."""
    from transformers import TrainerCallback

    class FeatureState(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = trl_compat.checkpoint_folder(args, state.global_step)
            if trainer.rollout_corr_state_saved != (str(folder), int(state.global_step)):
                save(trainer, folder)  # else written already, before the Hub push (save_before_push)

        def on_train_begin(self, args, state, control, **kwargs):
            folder, trainer.rollout_corr_resume_from = trainer.rollout_corr_resume_from, None
            if folder is not None:
                load(trainer, folder)

    return FeatureState()
