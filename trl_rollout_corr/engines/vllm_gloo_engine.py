"""The server side of the gloo weight-sync backend: a vLLM ``WeightTransferEngine`` that receives over gloo.

vLLM imports this module only in a server started with ``--weight-transfer-config
'{"backend": "trl_rollout_corr_gloo"}'`` (registered by ``vllm_weight_sync.register``, the package's
``vllm.general_plugins`` entry point). It follows vLLM 0.32's dense NCCL engine
(``vllm/distributed/weight_transfer/nccl_engine.py``) step for step:

* ``init_transfer_engine``: join the trainer's group (``GlooChannel``) as rank ``rank_offset`` + this worker's rank;
* ``start_weight_update``: ``initialize_layerwise_reload(model)``;
* ``receive_weights``: receive the announced tensors chunk by chunk and pass them to ``model.load_weights``
  (checkpoint names; vLLM fuses q/k/v and gate/up itself);
* ``finish_weight_update``: ``finalize_layerwise_reload(model, model_config)``, then re-run the tied LM head's
  ``process_weights_after_loading`` (``engines.vllm_cpu.reprocess_tied_layers``, shared with the in-process sync).

The last step is the one NCCL's engine does not need on a GPU. With tied embeddings ``lm_head.weight`` IS
``embed_tokens.weight``, but vLLM's CPU linear kernels (``dispatch_cpu_unquantized_gemm``: oneDNN, used for float32
on AVX2 CPUs and for bf16 on AVX-512 ones) keep a packed copy of the head's weight, made when the model was loaded.
The layerwise reload refreshes ``embed_tokens`` (it receives weights) but leaves the head alone (it receives none:
the trainer's ``named_parameters()`` lists the shared tensor once, under the embedding's name), so without the
re-pack the engine would sample from the new body and the OLD head. ``lm_head.weight``, when it is sent anyway with
tied embeddings, is received and dropped (vLLM would write it over the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trl_rollout_corr.engines.vllm_cpu import reprocess_tied_layers
from trl_rollout_corr.engines.vllm_weight_sync import (
    BACKEND,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooChannel,
    receive_tensors,
)

TIED_HEAD = "lm_head.weight"


def server_versions() -> dict[str, str]:
    """Versions on this side of the sync (named in errors next to the trainer's)."""
    from importlib import metadata

    import vllm

    try:
        ours = metadata.version("trl-rollout-corr")
    except metadata.PackageNotFoundError:
        ours = "not installed"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "trl-rollout-corr": ours}


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What the trainer sends to ``/init_weight_transfer_engine`` (JSON) for this backend.

    Fields: ``master_address``/``master_port`` (the trainer's ``TCPStore``), ``rank_offset`` (1: the trainer is rank
    0), ``world_size`` (1 + workers), ``chunk_bytes`` (broadcast chunk size, must equal the trainer's),
    ``timeout_s`` (rendezvous and per-broadcast wait), ``trainer_versions`` (for error messages).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    trainer_versions: dict[str, str] = field(default_factory=dict)


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """What the trainer sends to ``/update_weights``: one ``(name, dtype name, shape)`` per tensor, in order (the
    same fields as NCCL's, which is what TRL's ``VLLMClient.update_named_params`` builds)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor: got {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}."
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """vLLM worker side of the gloo weight sync (see the module docstring); CPU tensors only."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: GlooChannel | None = None
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self.trainer_versions: dict[str, str] = {}

    def _context(self) -> str:
        return f"{BACKEND}: server {server_versions()}, trainer {self.trainer_versions or 'unknown'}"

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group as rank ``rank_offset`` + this worker's global rank."""
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.chunk_bytes = int(init_info.chunk_bytes)
        self.trainer_versions = dict(init_info.trainer_versions)
        try:
            self.channel = GlooChannel(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} ({self._context()})") from exc

    def start_weight_update(self) -> None:
        """Put the model in vLLM's layer-by-layer reload (each layer is re-processed once all its weights arrive)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, without its ``torch.accelerator.synchronize()`` (no accelerator; gloo is blocking)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the announced tensors from the trainer (rank 0) and load them with ``model.load_weights``.

        Raises:
            RuntimeError: ``init_transfer_engine`` was not called, or the broadcast failed (naming the backend and
                both sides' versions).
        """
        if self.channel is None:
            raise RuntimeError(f"{BACKEND}: weight sync not initialized; call init_weight_transfer_engine first.")
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        chunks = receive_tensors(
            self.channel, update_info.names, update_info.dtype_names, update_info.shapes, self.chunk_bytes
        )
        try:
            with torch.no_grad():
                for chunk in chunks:
                    weights = [(name, t) for name, t in chunk if not (tied and name == TIED_HEAD)]
                    if weights:
                        self.model.load_weights(weights)
        except Exception as exc:
            # The trainer is still broadcasting the rest: receive it (nothing is loaded) so that it does not wait
            # for the gloo timeout, then leave vLLM's reload so that the server keeps serving.
            for _ in chunks:
                pass
            self._abort_reload()
            raise RuntimeError(
                f"weight sync failed ({type(exc).__name__}: {exc}); the server's weights may be partly updated: "
                f"sync again or restart the server; {self._context()}"
            ) from exc

    def finish_weight_update(self) -> None:
        """Finish the layer-by-layer reload, then re-pack a tied LM head (see the module docstring)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        with torch.no_grad():
            reprocess_tied_layers(self.model)  # the tied head (module docstring)

    def _abort_reload(self) -> None:
        """After a failed update: finish vLLM's layerwise reload (layers that received nothing get their tensors
        back) and re-pack a tied head; the worker then ends the update (``_weight_update_active = False``)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        with torch.no_grad():
            reprocess_tied_layers(self.model)  # the tied head (module docstring)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
