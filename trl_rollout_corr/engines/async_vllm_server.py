"""TRL's vLLM server as the asynchronous engine (issue 45, ``rollout_async_depth`` with ``use_vllm=True,
vllm_mode="server"``).

The engine process is the server of TRL's server mode (``trl vllm-serve`` on a GPU, NCCL;
``trl-rollout-corr vllm-serve`` on CPU, the gloo weight sync of ``engines/vllm_weight_sync.py``), driven through TRL's
own ``VLLMClient`` (``trainer.vllm_generation.vllm_client``): ``update_named_params`` + ``reset_prefix_cache`` to load
a version, ``generate`` to sample. Per-row seeds: TRL's server requests carry one ``SamplingParams`` for all their
prompts (``/v1/completions``: one ``seed`` per request), so identical prompts with one seed would sample identically;
this engine sends one request per row (``n=1``, ``seed=request_seed(seed, batch, row)``), concurrently, with TRL's
sampling arguments otherwise (``trl_compat.vllm_server_sampling``).

Versions: the server does not report which weights it holds, so the version of a batch is this engine's record of
the last load that completed before the batch's first request (the worker thread never loads inside a batch). A
server that dies fails the next request (``EngineError`` with the server log's last lines when ``log_path`` is
known); one that hangs is abandoned after ``timeout_s`` (its requests cannot be cancelled from the client; the
server process belongs to whoever started it).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Optional

import torch

from .async_pipeline import EngineError
from .daemon_requests import DaemonRequests

__all__ = ["VLLMServerEngine"]


class VLLMServerEngine:
    """TRL's vLLM server behind ``AsyncRolloutPipeline`` (module docstring).

    Args:
        client: TRL's ``VLLMClient`` with its weight-transfer communicator initialised (TRL's ``VLLMGeneration``
            does this in server mode).
        sampling: ``VLLMClient.generate`` keyword arguments except ``prompts``/``n`` (``trl_compat
            .vllm_server_sampling``); ``generation_kwargs`` gets each row's ``seed``.
        param_name: maps a policy parameter name to the server's (TRL's ``_fix_param_name_to_vllm``).
        timeout_s: seconds a load or a batch may take.
        log_path: the server's log file, when known (its last lines go into every ``EngineError``).
        concurrency: simultaneous requests.
    """

    def __init__(self, client: Any, *, sampling: dict, param_name=lambda name: name, timeout_s: float = 600.0,
                 log_path: Optional[str] = None, concurrency: int = 16) -> None:
        self.client, self.sampling, self.param_name = client, dict(sampling), param_name
        self.timeout_s, self.log_path = float(timeout_s), log_path
        self.version: Optional[int] = None
        self.record: list[tuple[int, int]] = []  # (batch, the version held when its requests were sent)
        self._pool = DaemonRequests(concurrency)
        self.pid = None  # not ours: the server belongs to whoever started it
        self.process = None

    def start(self) -> None:
        """Nothing to start: the server runs already (TRL connected to it)."""

    def snapshot(self, model: torch.nn.Module) -> dict:
        """A CPU copy of the policy's parameters under the server's names (TRL's server sync sends
        ``named_parameters``, not buffers)."""
        return {self.param_name(name): p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}

    def load(self, version: int, state: dict) -> None:
        """Push ``state`` to the server (``update_named_params``, then ``reset_prefix_cache``) as ``version``."""
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()]

        def push():
            self.client.update_named_params(metadata, iter(state.items()))
            self.client.reset_prefix_cache()

        self._wait([self._pool.submit(push)], f"load of version {version}")
        self.version = int(version)

    def generate(self, batch: int, prompts: list, seeds: list) -> tuple[list, list, int]:
        """One request per row (``n=1`` and its own seed). Returns (completion ids, mu, the version held)."""
        version = self.version
        extra = dict(self.sampling.get("generation_kwargs") or {})
        sampling = {k: v for k, v in self.sampling.items() if k != "generation_kwargs"}
        futures = [self._pool.submit(self.client.generate, prompts=[list(p)], n=1, **sampling,
                                     generation_kwargs={**extra, "seed": int(s)}) for p, s in zip(prompts, seeds)]
        outputs = self._wait(futures, f"generation batch {batch}")
        ids = [out["completion_ids"][0] for out in outputs]
        log_probs = [[step[0] for step in out["logprobs"][0]] for out in outputs]
        self.record.append((int(batch), version))
        return ids, log_probs, version

    def _wait(self, futures: list, what: str) -> list:
        done, pending = concurrent.futures.wait(futures, timeout=self.timeout_s)
        if pending:
            for f in pending:
                f.cancel()
            raise EngineError(f"the vLLM server did not answer its {what} within {self.timeout_s:g} s (hung?); "
                              f"raise rollout_async_timeout_s if it is only slow.\n{self.log_tail()}")
        try:
            return [f.result() for f in futures]
        except Exception as err:
            raise EngineError(f"the vLLM server failed its {what}: {err}\n{self.log_tail()}") from err

    def log_tail(self, lines: int = 12) -> str:
        """The last lines of the server's log (``log_path``), or a note that it is unknown."""
        if self.log_path is None:
            return "(the server's log is not known to the trainer: see the vllm-serve output)"
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = ["(no log)"]
        return f"server log {self.log_path}, last lines:\n" + "\n".join(f"  {line}" for line in text)

    def close(self) -> None:
        """Drop the request threads (requests in flight are abandoned, not waited for: they run on daemon threads,
        so a request stuck on a hung server cannot hold the interpreter at exit). Idempotent."""
        self._pool.shutdown()
