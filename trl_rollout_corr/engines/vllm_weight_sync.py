"""A CPU weight-sync backend for vLLM's server: the trainer broadcasts its weights to ``vllm serve`` over gloo.

TRL 1.16's server mode (``use_vllm=True, vllm_mode="server"``) pushes the trainer's weights into ``vllm serve``
through vLLM's NCCL weight-transfer engine (``--weight-transfer-config '{"backend": "nccl"}'``): the trainer and the
vLLM workers join one NCCL group and the trainer broadcasts. NCCL needs CUDA on both sides, so on a CPU machine
TRL's client refuses (``VLLMClient.init_communicator``: "needs a CUDA device") and vLLM's engine asks for an
accelerator. This module is the same protocol over a gloo group on TCP, in three parts:

* the wire format, shared by both sides: the tensors of one update are announced as (names, dtype names, shapes)
  and broadcast from rank 0 (the trainer) in chunks of at most ``chunk_bytes`` (one flat uint8 tensor per chunk;
  a tensor larger than a chunk travels alone). Both sides cut the chunks from the announced metadata
  (``plan_chunks``), so the receiver knows every chunk's size before it arrives;
* ``GlooChannel``: a gloo process group of its own (a ``TCPStore`` hosted by the trainer, rank 0, and a
  ``ProcessGroupGloo`` bound to the address given), outside ``torch.distributed``'s default group, like vLLM's
  ``StatelessProcessGroup`` for NCCL;
* ``register``: the ``vllm.general_plugins`` entry point of this distribution. vLLM calls it in every process it
  starts (API server, engine core, workers); it registers the server side, ``GlooWeightTransferEngine``
  (``engines/vllm_gloo_engine.py``), under the backend name ``BACKEND`` in vLLM's weight-transfer factory, lazily
  (nothing is imported until a server is started with that backend). It imports neither TRL nor vLLM's engine
  code, and it changes nothing for servers that ask for another backend: ``trl vllm-serve`` on a GPU still gets
  ``nccl``.

The trainer side is ``trl_compat.install_vllm_client_cpu_weight_sync`` (the hook into TRL's ``VLLMClient``); the
server is started with this backend by ``trl-rollout-corr vllm-serve`` (``engines/vllm_serve.py``).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Iterable, Iterator, Sequence

import torch

BACKEND = "trl_rollout_corr_gloo"
"""The name of this backend in vLLM's weight-transfer factory (``--weight-transfer-config '{"backend": ...}'``)."""

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes per broadcast chunk. SmolLM2-135M in float32 (538 MB) travels in 9 chunks."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a rendezvous or a broadcast may wait for the other side before gloo raises."""


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a vLLM-style dtype name (``"float32"``, ``"bfloat16"``; ``"torch."`` prefix allowed).

    Raises:
        ValueError: the name is not a torch dtype.
    """
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (expected e.g. 'float32' or 'bfloat16').")
    return dtype


def tensor_nbytes(dtype_name: str, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    return math.prod(int(s) for s in shape) * dtype_from_name(dtype_name).itemsize


def plan_chunks(nbytes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive tensors into broadcast chunks of at most ``chunk_bytes`` bytes each.

    Args:
        nbytes: bytes of each tensor, in broadcast order.
        chunk_bytes: the most bytes per chunk; a tensor larger than that is a chunk on its own.

    Returns:
        One list of tensor indices per chunk, in order; every index appears once.

    Raises:
        ValueError: ``chunk_bytes`` is not positive.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}.")
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if current and size + n > chunk_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        chunks.append(current)
    return chunks


class GlooChannel:
    """A gloo process group between the trainer (rank 0, hosts the ``TCPStore``) and the vLLM workers.

    Args:
        host: the address rank 0 listens on and every rank's gloo device binds to (``127.0.0.1`` for a server on
            the same machine).
        port: the ``TCPStore`` port on ``host``.
        rank: 0 for the trainer, 1 + worker rank for vLLM workers.
        world_size: 1 + the number of vLLM workers.
        timeout_s: seconds to wait for the rendezvous and for each broadcast.

    Raises:
        RuntimeError: the rendezvous did not complete (port in use on rank 0, peer never came), with the address.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self.host, self.port, self.rank, self.world_size = host, int(port), int(rank), int(world_size)
        timeout = timedelta(seconds=timeout_s)
        try:
            self.store = TCPStore(host, self.port, self.world_size, is_master=self.rank == 0, timeout=timeout)
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            self.group = ProcessGroupGloo(PrefixStore(BACKEND, self.store), self.rank, self.world_size, options)
        except Exception as exc:
            raise RuntimeError(
                f"{BACKEND}: rank {self.rank} of {self.world_size} could not join the weight-sync group at "
                f"{host}:{self.port} ({type(exc).__name__}: {exc}). Is the port free on the trainer (TRL's "
                "`vllm_group_port`), and can the server reach that address?"
            ) from exc

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast a contiguous CPU tensor in place from rank 0 to every rank (blocks until done)."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Drop the group and the store (the peer's next broadcast then fails instead of waiting forever)."""
        self.group = None
        self.store = None


def send_tensors(
    channel: GlooChannel,
    metadata: Sequence[tuple[str, str, Sequence[int]]],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Rank 0's side of one update: broadcast ``named_tensors`` chunk by chunk, as announced in ``metadata``.

    Args:
        channel: the trainer's ``GlooChannel`` (rank 0).
        metadata: one ``(name, dtype name, shape)`` per tensor, in order (what the server was sent).
        named_tensors: ``(name, tensor)`` pairs matching ``metadata`` one to one (any device; copied to CPU).
        chunk_bytes: the chunk size the receiver was told (``init_info["chunk_bytes"]``).

    Returns:
        Bytes sent.

    Raises:
        ValueError: a tensor's name, dtype or shape differs from its metadata entry, or the counts differ (raised
            before that tensor's chunk is sent; the receiver then times out).
    """
    sizes = [tensor_nbytes(dtype, shape) for _, dtype, shape in metadata]
    pairs = iter(named_tensors)
    sent = 0
    for chunk in plan_chunks(sizes, chunk_bytes):
        parts = []
        for i in chunk:
            try:
                name, tensor = next(pairs)
            except StopIteration:
                raise ValueError(f"{len(metadata)} tensors were announced but only {i} were given.") from None
            want_name, want_dtype, want_shape = metadata[i]
            if name != want_name or tensor.dtype != dtype_from_name(want_dtype) or list(tensor.shape) != list(
                want_shape
            ):
                raise ValueError(
                    f"tensor {i} is {name!r} {tensor.dtype} {list(tensor.shape)} but {want_name!r} {want_dtype} "
                    f"{list(want_shape)} was announced."
                )
            parts.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        channel.broadcast(flat)
        sent += flat.numel()
    if next(pairs, None) is not None:
        raise ValueError(f"more tensors were given than the {len(metadata)} announced.")
    return sent


def receive_tensors(
    channel: GlooChannel,
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A worker's side of one update: yields the tensors chunk by chunk as they arrive from rank 0.

    Args:
        channel: the worker's ``GlooChannel``.
        names, dtype_names, shapes: the announced metadata, one entry per tensor.
        chunk_bytes: as ``send_tensors``.

    Yields:
        ``[(name, tensor), ...]`` for one chunk; the tensors are views of a fresh CPU buffer, valid after the next
        chunk arrives.
    """
    sizes = [tensor_nbytes(d, s) for d, s in zip(dtype_names, shapes, strict=True)]
    for chunk in plan_chunks(sizes, chunk_bytes):
        flat = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8)
        channel.broadcast(flat)
        out, offset = [], 0
        for i in chunk:
            part = flat[offset : offset + sizes[i]]
            out.append((names[i], part.view(dtype_from_name(dtype_names[i])).view(list(shapes[i]))))
            offset += sizes[i]
        yield out


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``GlooWeightTransferEngine`` under ``BACKEND``, and set the
    queue readers' busy-wait from ``TRL_ROLLOUT_CORR_VLLM_SPIN_S`` when it is set (``engines/vllm_spin.py``).

    Lazy (vLLM imports ``trl_rollout_corr.engines.vllm_gloo_engine`` only when a server asks for this backend) and
    idempotent (vLLM calls plugins once per process; a second call is a no-op). Registering a name changes nothing
    for servers started with another backend, so CUDA servers keep TRL's NCCL path.

    Raises:
        ValueError: ``TRL_ROLLOUT_CORR_VLLM_SPIN_S`` is not a number >= 0 (the server stops at its start).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .vllm_spin import apply_from_env

    apply_from_env()

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "trl_rollout_corr.engines.vllm_gloo_engine", "GlooWeightTransferEngine"
        )
    except ValueError:  # "already registered": plugins may be loaded twice in one process
        pass
