"""Where ``policy_lag_split`` keeps the weights of each version in use, and the model its version forward runs.

Two stores, chosen by the backend (``store_for``):

* ``FullCopies``: one process, DDP, DeepSpeed ZeRO-1/2 (every rank holds the whole model, so its own shard is the
  whole model). Per version a copy of the unwrapped policy's ``state_dict``, loaded into one scratch deep copy of the
  policy for the version forward (a plain local module: that forward is no collective).
* ``RankShards``: DeepSpeed ZeRO-3 and FSDP2. Per version, this rank's own shard of each parameter only: ZeRO-3
  ``param.ds_tensor`` (the rank's flat partition), FSDP2 the DTensor's local shard (``to_local()``); a parameter the
  backend keeps whole on every rank (none in the tests) is kept whole. A kept shard is a clone of the live one, so it
  lives where the backend keeps the rank's shard: CPU memory under ZeRO-3 ``offload_param`` or FSDP2
  ``CPUOffloadPolicy`` (the offload the user asked the backend for; on CPU ranks it is the same memory). For the
  version forward each kept shard is swapped with the live shard in place (one parameter's shard of scratch at a
  time), the live model runs the forward (the backend all-gathers the version's shards, a collective: every rank
  runs it, ``LagSplit`` sees to that), and the shards are swapped back, bit for bit.

Memory per version and rank: ``kept_bytes`` = the bytes of this rank's shards, about the full parameter bytes / world
size (measured: ``benchmarks/lag_split_shard_memory.py``, RESULTS.md).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch
from trl.trainer.grpo_trainer import disable_gradient_checkpointing

from . import trl_compat


class FullCopies:
    """A ``state_dict`` copy of the whole policy per version; the version forward runs a scratch copy (module
    docstring). ``collective`` False: a rank need not run it for versions it holds no rows of."""

    collective = False

    def __init__(self) -> None:
        self.model: Optional[torch.nn.Module] = None  # the scratch copy that scores old versions

    def keep(self, trainer) -> dict[str, torch.Tensor]:
        """A copy of the unwrapped policy's current state dict."""
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        return {k: v.detach().clone() for k, v in state.items()}

    @staticmethod
    def kept_bytes(kept: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in kept.values())

    @contextlib.contextmanager
    def loaded(self, trainer, kept: dict[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
        """The scratch copy (eval mode) with the version's weights loaded."""
        if self.model is None:
            self.model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).eval()
        self.model.load_state_dict(kept)
        yield self.model


def _local_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor holding this rank's own part of ``param``, whose in-place change the backend's next all-gather
    sees: ZeRO-3 ``ds_tensor`` (flat partition), FSDP2 DTensor ``to_local()`` (a view of FSDP's padded shard
    storage; call under ``torch.no_grad``), else the parameter's data (held whole)."""
    ds = getattr(param, "ds_tensor", None)
    if ds is not None:
        return ds.data
    if hasattr(param, "to_local"):
        return param.to_local()
    return param.data


class RankShards:
    """This rank's own shards per version, swapped into the live model for the version forward (module docstring).
    ``collective`` True: every rank must run each version forward.

    Raises:
        NotImplementedError: (``check``) ZeRO-3 with ``offload_param`` on NVMe (the partitions are swapped out to
            disk) or hpZ (``zero_hpz_partition_size`` > 1: a second partition the all-gather reads).
    """

    collective = True

    def __init__(self, backend: str) -> None:
        self.backend = backend

    @staticmethod
    def check(trainer) -> None:
        """Refuse the ZeRO-3 settings whose shards are not the rank's ``ds_tensor`` in memory (class Raises)."""
        ds = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        zero = (getattr(ds, "deepspeed_config", None) or {}).get("zero_optimization", {}) if ds else {}
        device = str((zero.get("offload_param") or {}).get("device", "none")).lower()
        if device == "nvme" or int(zero.get("zero_hpz_partition_size", 1) or 1) > 1:
            raise NotImplementedError(
                "policy_lag_split on DeepSpeed ZeRO-3 keeps each version as this rank's parameter partitions "
                "(ds_tensor) in memory; with offload_param on NVMe or hpZ (zero_hpz_partition_size > 1) the backend "
                "reads partitions it keeps elsewhere. Use offload_param 'cpu' or 'none' and no hpZ, or unset "
                "policy_lag_split."
            )

    @staticmethod
    def _params(trainer) -> list[torch.nn.Parameter]:
        return list(trainer.accelerator.unwrap_model(trainer.model).parameters())

    def keep(self, trainer) -> list[torch.Tensor]:
        """A clone of this rank's shard of every parameter (module order), where the backend keeps it."""
        reshard_fsdp2(trainer.accelerator.unwrap_model(trainer.model))
        with torch.no_grad():
            return [_local_shard(p).detach().clone() for p in self._params(trainer)]

    @staticmethod
    def kept_bytes(kept: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in kept)

    @contextlib.contextmanager
    def loaded(self, trainer, kept: list[torch.Tensor]) -> Iterator[torch.nn.Module]:
        """The live model (``trainer.model``, gradient checkpointing off as for pi_old) with the version's shards
        swapped in; swapped back on exit, also on an error. Every rank must enter this together (the gathered
        parameters are refreshed by a collective).

        Raises:
            RuntimeError: the kept shards do not fit the live ones (their number, or a shape: the backend
                re-partitioned the model), before anything is swapped.
        """
        reshard_fsdp2(trainer.accelerator.unwrap_model(trainer.model))  # the registered parameters: the shards
        params = self._params(trainer)
        if len(params) != len(kept):
            raise RuntimeError(f"policy_lag_split: {len(kept)} shards kept, the model has {len(params)} parameters.")
        with torch.no_grad():
            for p, shard in zip(params, kept):
                live = _local_shard(p)
                if live.shape != shard.shape:
                    raise RuntimeError(f"policy_lag_split: a kept shard of shape {tuple(shard.shape)} for a live "
                                       f"shard of shape {tuple(live.shape)}; the backend re-partitioned the model.")
        self._swap(trainer, params, kept)
        try:
            with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
                yield trainer.model
        finally:
            self._swap(trainer, params, kept)

    def _swap(self, trainer, params: list, kept: list[torch.Tensor]) -> None:
        """Exchange the live shards with ``kept`` in place (their contents trade places), one parameter at a time
        (shapes checked by ``loaded``). On an error midway the exchanges done are undone, so the live model keeps
        its own weights and ``kept`` the version's (a failed ZeRO-3 refresh may leave the gathered copies of
        persistent parameters refreshed from the version: no collective runs again on an error path)."""
        reshard_fsdp2(trainer.accelerator.unwrap_model(trainer.model))  # the next forward gathers the new shards
        done = 0
        with torch.no_grad():
            try:
                for p, shard in zip(params, kept):
                    _exchange(_local_shard(p), shard)
                    done += 1
                _refresh_gathered_zero3(params)
            except BaseException:
                for p, shard in zip(params[:done], kept[:done]):
                    _exchange(_local_shard(p), shard)
                raise


def _exchange(live: torch.Tensor, shard: torch.Tensor) -> None:
    """Trade the contents of two tensors of one shape in place (its own inverse)."""
    scratch = live.clone()
    live.copy_(shard)
    shard.copy_(scratch)


def reshard_fsdp2(model: torch.nn.Module) -> None:
    """FSDP2: reshard every ``FSDPModule`` (frees any all-gathered parameter, local only), so that the next forward
    all-gathers from the shards; a no-op elsewhere."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _refresh_gathered_zero3(params: list) -> None:
    """ZeRO-3: the parameters held gathered right now (persistent ones, below ``stage3_param_persistence_threshold``)
    re-assembled from the partitions (``ds_tensor``), as DeepSpeed does after each optimizer step: an all-gather
    over each parameter's ``ds_process_group``, in module order (the same on every rank)."""
    gathered = [p for p in params if getattr(p, "ds_tensor", None) is not None and p.data.numel() == p.ds_numel > 0]
    for p in gathered:
        group = p.ds_process_group
        parts = [torch.empty_like(p.ds_tensor.data) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, p.ds_tensor.data.contiguous(), group=group)
        p.data.copy_(torch.cat(parts)[: p.ds_numel].view(p.data.shape))


def store_for(trainer):
    """The store for this trainer's backend (module docstring): ``RankShards`` on ZeRO-3 / FSDP2, else
    ``FullCopies``.

    Raises:
        NotImplementedError: FSDP1 (its ``FlatParameter`` shards are not per parameter, and its forward was not
            tested here), or a ZeRO-3 setting ``RankShards.check`` refuses.
    """
    backend = trl_compat.sharded_backend(trainer.accelerator)
    if backend is None:
        return FullCopies()
    if backend == "FSDP1":
        raise NotImplementedError(
            "policy_lag_split is not supported on FSDP1: its version store keeps each version as the rank's own "
            "shard of each parameter (DeepSpeed ZeRO-3 ds_tensor, FSDP2 DTensor local shard), and FSDP1's "
            "FlatParameter is neither (not tested here). Use FSDP2 (fsdp_version 2), DeepSpeed, or DDP, or unset "
            "policy_lag_split."
        )
    RankShards.check(trainer)
    return RankShards(backend)
