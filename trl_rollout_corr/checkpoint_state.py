"""The features' resume state in the checkpoint: every ``hooks.Feature.state_dict`` saved with each checkpoint,
restored when training resumes from it (the one checkpoint mechanism of the features).

Every rank writes ``rollout_corr_features.rank-<r>.pt`` (``torch.save``) into ``checkpoint-<global_step>`` when the
Trainer has saved it (``on_save``): the state is per rank (the rollout records' counters, the lag split's kept weights
or this rank's shards of them), so each rank reads back its own file. The file holds ``{"format", "global_step",
"rank", "world_size", "features": [names in FEATURES order], "state": {name: state_dict}}``.

A run resumed from a checkpoint (``RolloutCorrGRPOTrainer.train(resume_from_checkpoint=...)``, resolved as the Trainer
resolves it: ``trl_compat.resume_checkpoint``) restores every feature's state at ``on_train_begin``: after the
Trainer loaded the model, the optimizer and ``TrainerState``, before the first step. It refuses, naming the fix, a
checkpoint without the file, of another world size or step, or whose features differ from the run's (the features
follow the config).

The coupling to transformers' Trainer (the checkpoint folder, the resolution of ``resume_from_checkpoint``, the
order of saving, loading and the callbacks) is in ``trl_compat.trainer_state``, pinned in ``tests/test_trl_compat.py``.
Hyperparameter search (a trial's own output folder) is not supported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import trl_compat

if TYPE_CHECKING:
    from .trainer import RolloutCorrGRPOTrainer

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


def load(trainer: "RolloutCorrGRPOTrainer", folder: os.PathLike | str) -> None:
    """Restore every feature's state from this rank's file in checkpoint ``folder``.

    Raises:
        ValueError: no file (a checkpoint not written by this trainer), a file of another format, world size or step
            than the resumed ``TrainerState``'s, or of other features than this run's (each message names the fix).
    """
    rank, world = int(trainer.accelerator.process_index), int(trainer.accelerator.num_processes)
    path = state_file(folder, rank)
    if not path.is_file():
        raise ValueError(
            f"Resuming from {folder}: it has no {path.name}, the features' resume state (policy lag split, support "
            "matching, rollout records) that RolloutCorrGRPOTrainer saves with every checkpoint; it was saved by "
            "another trainer or an older trl_rollout_corr (or for another number of processes). Resume from a "
            "checkpoint this trainer saved, or start a new run from its weights (model=<checkpoint folder>, "
            "without resume_from_checkpoint).")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    step = int(trainer.state.global_step)
    if payload.get("format") != FORMAT or payload.get("world_size") != world or payload.get("global_step") != step:
        raise ValueError(
            f"{path}: format {payload.get('format')}, {payload.get('world_size')} processes, step "
            f"{payload.get('global_step')}; this run resumes at step {step} on {world} processes with format "
            f"{FORMAT}. Resume with the checkpoint's number of processes and trl_rollout_corr version, from the "
            "checkpoint folder the file was saved in.")
    ours = [f.name for f in trainer.rollout_corr_features]
    theirs = list(payload["features"])
    if theirs != ours:
        missing, new = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        raise ValueError(
            f"Resuming from {folder}: it was saved by a run with the features {theirs}, this run has {ours} (not "
            f"here: {missing}, new here: {new}). Each feature's state continues the run it was saved by, and the "
            f"features follow the config ({FEATURE_FIELDS}): resume with the checkpoint's settings of these, or "
            "start a new run from its weights (model=<checkpoint folder>, without resume_from_checkpoint).")
    for feature in trainer.rollout_corr_features:
        feature.load_state_dict(payload["state"][feature.name])


def callback(trainer: "RolloutCorrGRPOTrainer"):
    """The ``TrainerCallback`` of the mechanism: ``on_save`` writes this rank's file into the checkpoint just saved
    (``trl_compat.checkpoint_folder``), ``on_train_begin`` restores it from ``trainer.rollout_corr_resume_from``
    (set by ``RolloutCorrGRPOTrainer.train``; consumed)."""
    from transformers import TrainerCallback

    class FeatureState(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            save(trainer, trl_compat.checkpoint_folder(args, state.global_step))

        def on_train_begin(self, args, state, control, **kwargs):
            folder, trainer.rollout_corr_resume_from = trainer.rollout_corr_resume_from, None
            if folder is not None:
                load(trainer, folder)

    return FeatureState()
