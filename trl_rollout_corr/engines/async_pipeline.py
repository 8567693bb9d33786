"""Asynchronous generation (issue 45): an engine in its own process generates the next batches while the trainer
trains, with exact versions.

Two parts, no TRL in either (the trainer side is ``async_generation.py``):

* ``AsyncRolloutPipeline``: one worker thread owns the engine and serialises its requests ("load version v",
  "generate batch j"), so the weights never change inside a batch. Generation batch ``j`` is generated with exactly
  the weights of version ``batch_version(j)`` (the trainer's rule: ``max(0, s_j - d)``, ``s_j`` the optimizer step
  that first trains batch j, d the depth; as the "one-step off-policy" / fully asynchronous pipelines of verl,
  AReaL, slime, prime-rl and SkyRL). The trainer ``publish``-es a CPU copy of its weights after every optimizer step
  that some batch needs (at most d + 1 versions are held), so training never waits for a weight push; the worker
  waits for the version it needs (``engine_idle_s``), the trainer for its batch (``trainer_wait_s``).
* ``TransformersProcessEngine``: a transformers causal LM in a child process (its own interpreter), sampling each
  row with its own seed (``request_seed``) and recording the version it held for every request (its own record,
  returned with every result and written to its log). It samples the temperature-scaled full distribution only
  (no top-k / top-p / penalties), in float32, one row at a time: exact and reproducible, meant for CPU runs and the
  tests; a vLLM server engine fits the same methods (``start``, ``load``, ``generate``, ``log_tail``, ``close``).

Faults: an engine that dies, answers an error or does not answer within ``timeout_s`` raises ``EngineError`` in the
trainer (at its next ``take``) with the engine's last log lines; a weight load that fails is such an error (never
generate on unknown weights); ``close`` (also on an exception or Ctrl-C, from the trainer) stops the thread and the
process, killing it after a grace period.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["AsyncRolloutPipeline", "BatchResult", "EngineError", "TransformersProcessEngine", "request_seed"]


# The child's start-up (a fresh interpreter importing torch and transformers, then the model) may take longer than
# one request; it gets at least this long (seconds).
STARTUP_TIMEOUT_S = 300.0


def request_seed(seed: int, batch: int, row: int) -> int:
    """The sampling seed of row ``row`` of generation batch ``batch`` in a run seeded ``seed``: NumPy's
    ``SeedSequence([seed, batch, row])`` (well mixed, platform independent), an int in [0, 2**63).

    Raises:
        ValueError: a negative argument (``SeedSequence`` entropy must be >= 0).
    """
    if min(seed, batch, row) < 0:
        raise ValueError(f"request_seed needs seed, batch, row >= 0, got {(seed, batch, row)}.")
    state = np.random.SeedSequence([int(seed), int(batch), int(row)]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


class EngineError(RuntimeError):
    """The rollout engine died, hung (no answer within the timeout) or failed a request; the message carries its
    last log lines."""


@dataclasses.dataclass
class BatchResult:
    """One generated batch.

    Attributes:
        completion_ids: per row, the sampled token ids (ending at the first EOS, included).
        log_probs: per row, one float per completion token: the sampled token's log-prob (nats) under the
            distribution that sampled it (mu).
        version: the version the engine held while it generated every row (its own record).
        generate_s: seconds the engine took for the batch (wall clock).
        engine_idle_s: seconds the worker waited for the batch's version to be published before it.
        trainer_wait_s: seconds the trainer waited for the result (set by ``take``).
    """

    completion_ids: list
    log_probs: list
    version: int
    generate_s: float
    engine_idle_s: float
    trainer_wait_s: float = 0.0


# ------------------------------------------------------------------------------------------------------ the engine
def _send(conn, obj) -> None:
    """Plain pickle (tensors by value): no shared-memory handles between unrelated processes."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _engine_main(fd: int, model_dir: str, temperature: float, max_tokens: int, eos_token_ids: tuple,
                 threads: int) -> None:  # pragma: no cover (runs in the child process)
    """The child process (``python -m trl_rollout_corr.engines.async_pipeline``; stdout and stderr are the log):
    load the model, then serve ("load", v, state) / ("generate", j, prompts, seeds) / ("close",) until told to stop
    or the trainer's end of the socket closes."""
    from transformers import AutoModelForCausalLM

    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    conn = Connection(fd)
    torch.set_num_threads(threads)
    say(f"engine pid {os.getpid()}: loading {model_dir} ({threads} thread(s))")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    version = None
    eos = set(eos_token_ids)
    _send(conn, ("ok", None))
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            say("the trainer's end of the socket closed: exiting")
            return
        op = message[0]
        try:
            if op == "load":
                _, new_version, state = message
                model.load_state_dict(state, strict=True)
                version = new_version
                say(f"loaded version {version}")
                _send(conn, ("ok", version))
            elif op == "generate":
                _, batch, prompts, seeds = message
                say(f"batch {batch}: {len(prompts)} rows at version {version}")
                rows = [_sample_row(model, p, s, temperature, max_tokens, eos) for p, s in zip(prompts, seeds)]
                _send(conn, ("ok", ([r[0] for r in rows], [r[1] for r in rows], version)))
            elif op == "close":
                say("closing")
                _send(conn, ("ok", None))
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception:  # the trainer raises EngineError with this text
            text = traceback.format_exc()
            say(f"request {op!r} failed:\n{text}")
            _send(conn, ("error", text))


@torch.no_grad()
def _sample_row(model, prompt: Sequence[int], seed: int, temperature: float, max_tokens: int,
                eos: set) -> tuple[list, list]:
    """Sample one completion from ``softmax(logits / temperature)`` with its own ``torch.Generator(seed)``.
    Returns (token ids, their log-probs in nats)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    past = None
    tokens, log_probs = [], []
    for _ in range(max_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        tokens.append(token)
        log_probs.append(float(logp[token]))
        if token in eos:
            break
        ids = torch.tensor([[token]], dtype=torch.long)
    return tokens, log_probs


class TransformersProcessEngine:
    """A transformers causal LM generating in a child process (module docstring).

    Args:
        model_dir: a ``save_pretrained`` directory of the policy (the keys ``load`` states must match).
        temperature: > 0; the engine samples ``softmax(logits / temperature)`` (no truncation, no penalties).
        max_tokens: completion tokens per row at most.
        eos_token_ids: ids that end a completion (kept in it).
        threads: torch threads of the child.
        timeout_s: seconds one request (a load, a batch) may take before the engine counts as hung; the start-up
            gets at least ``STARTUP_TIMEOUT_S``.
        log_path: the child's log file (its last lines go into every ``EngineError``).

    Raises:
        ValueError: temperature <= 0, max_tokens < 1, threads < 1 or timeout_s <= 0.
    """

    def __init__(self, model_dir: str, *, temperature: float, max_tokens: int, eos_token_ids: Sequence[int],
                 threads: int = 1, timeout_s: float = 600.0, log_path: str) -> None:
        if not temperature > 0:
            raise ValueError(f"the engine samples softmax(logits / temperature): temperature must be > 0, "
                             f"got {temperature}.")
        if max_tokens < 1 or threads < 1 or not timeout_s > 0:
            raise ValueError(f"max_tokens and threads must be >= 1 and timeout_s > 0, got {max_tokens}, {threads}, "
                             f"{timeout_s}.")
        self.model_dir, self.temperature, self.max_tokens = str(model_dir), float(temperature), int(max_tokens)
        self.eos_token_ids, self.threads, self.timeout_s = tuple(int(t) for t in eos_token_ids), threads, timeout_s
        self.log_path = str(log_path)
        self.process = None
        self._conn = None
        self._hung = False
        self._sending = threading.Lock()  # held while a request is written (close must not write into it)

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Start the child (``python -m trl_rollout_corr.engines.async_pipeline``, so the caller's ``__main__`` is
        never re-imported) and wait (``timeout_s``) until it has loaded the model."""
        ours, theirs = socket.socketpair()
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        spec = json.dumps(dict(fd=theirs.fileno(), model_dir=self.model_dir, temperature=self.temperature,
                               max_tokens=self.max_tokens, eos_token_ids=list(self.eos_token_ids),
                               threads=self.threads))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, spec], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                                            env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._answer("start-up", max(self.timeout_s, STARTUP_TIMEOUT_S))

    def snapshot(self, model: torch.nn.Module) -> dict:
        """A CPU copy of the policy's ``state_dict`` (what ``load`` takes)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    def load(self, version: int, state: dict) -> None:
        """Load ``state`` (name -> tensor, the policy's ``state_dict`` keys) as ``version``."""
        self._call(("load", int(version), state), f"load of version {version}")

    def generate(self, batch: int, prompts: list, seeds: list) -> tuple[list, list, int]:
        """Generate one completion per prompt (token-id lists), row i with ``seeds[i]``.
        Returns (completion ids, log-probs, the version the engine held)."""
        return self._call(("generate", int(batch), [list(p) for p in prompts], [int(s) for s in seeds]),
                          f"generation batch {batch}")

    def _call(self, message: tuple, what: str):
        try:
            with self._sending:
                _send(self._conn, message)
        except OSError as err:
            raise EngineError(f"the rollout engine (pid {self.pid}) {self._gone()} before its {what}.\n"
                              f"{self.log_tail()}") from err
        except (TypeError, ValueError) as err:  # ``close`` closed the socket under a write (its handle is None)
            if self.process is not None:
                raise
            raise EngineError(f"the rollout engine (pid {self.pid}) was closed (the pipeline is stopping) during "
                              f"its {what}.") from err
        return self._answer(what)

    def _gone(self) -> str:
        """How the child's end of the socket went away: its exit code once it is reaped (1 s at most)."""
        process = self.process
        if process is None:
            return "was closed (the pipeline is stopping)"
        try:
            return f"died (exit code {process.wait(1.0)})"
        except subprocess.TimeoutExpired:
            return "closed its socket"

    def _answer(self, what: str, timeout_s: Optional[float] = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.05):
            if self.process.poll() is not None:
                raise EngineError(f"the rollout engine (pid {self.pid}) died (exit code {self.process.returncode}) "
                                  f"during its {what}.\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self._hung = True  # close kills it at once
                raise EngineError(f"the rollout engine (pid {self.pid}) did not answer its {what} within "
                                  f"{timeout_s:g} s (hung?); raise rollout_async_timeout_s if it is only "
                                  f"slow.\n{self.log_tail()}")
        try:
            status, value = _recv(self._conn)
        except (EOFError, OSError) as err:
            raise EngineError(f"the rollout engine (pid {self.pid}) {self._gone()} during its {what}.\n"
                              f"{self.log_tail()}") from err
        if status == "error":
            raise EngineError(f"the rollout engine failed its {what}:\n{value}\n{self.log_tail()}")
        return value

    def log_tail(self, lines: int = 12) -> str:
        """The last ``lines`` lines of the engine's log, as one labelled block."""
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = ["(no log)"]
        return f"engine log {self.log_path}, last lines:\n" + "\n".join(f"  {line}" for line in text)

    def close(self, grace_s: float = 5.0) -> None:
        """Ask the child to exit; terminate, then kill it if it has not within ``grace_s``. A hung child, or one
        a request is still being written to (a stopped child that no longer reads: the writer blocks in the
        socket), is killed at once without writing to it: a write there would block this thread too. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        polite = process.poll() is None and self._sending.acquire(blocking=False)
        if polite:
            try:
                if select.select([], [self._conn.fileno()], [], 0)[1]:  # room for the tiny message now
                    _send(self._conn, ("close",))
                else:
                    polite = False
            except OSError:
                pass
            finally:
                self._sending.release()
        self._hung = self._hung or not polite
        for stop in ((process.kill,) if self._hung else (None, process.terminate, process.kill)):
            if stop is not None:
                stop()
            try:
                process.wait(grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if not polite and self._sending.acquire(timeout=grace_s):  # a write blocked in the socket fails now that
            self._sending.release()  # the child is gone (EPIPE): let it, before its socket is closed under it
        self._conn.close()


# ---------------------------------------------------------------------------------------------------- the pipeline
class AsyncRolloutPipeline:
    """The worker thread between the trainer and an engine (module docstring).

    Args:
        engine: started, with ``snapshot(model)``, ``load(version, state)``, ``generate(batch, prompts, seeds) ->
            (ids, log-probs, version)``, ``log_tail()`` and ``close()`` (``TransformersProcessEngine``,
            ``engines.async_vllm_server.VLLMServerEngine``).
        batch_version: generation batch index j -> the version it must be generated with (non-decreasing).
        timeout_s: seconds ``take`` waits for a batch beyond the engine's own timeouts.
        first_batch: the index of the first batch ``submit`` takes (> 0 on a resumed run).
        end_batch: one past the last batch the run trains (None: no end); no version only later batches need is
            published, no later batch is submitted.

    The trainer calls ``publish`` (after every optimizer step), ``submit`` (ahead of time, in batch order) and
    ``take`` (when it trains the batch, in the same order), then ``close``.
    """

    def __init__(self, engine, *, batch_version: Callable[[int], int], timeout_s: float = 600.0,
                 first_batch: int = 0, end_batch: Optional[int] = None) -> None:
        self.engine = engine
        self.end_batch = end_batch
        self.batch_version = batch_version
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._published: dict[int, dict] = {}
        self._requests: collections.deque = collections.deque()
        self._results: dict[int, BatchResult] = {}
        self._submitted = int(first_batch) - 1
        self._error: Optional[BaseException] = None
        self._stopping = False
        self.loaded_version: Optional[int] = None
        self.served: list[tuple[int, int]] = []  # (batch, the engine's version for it), in order
        self._thread = threading.Thread(target=self._run, name="rollout-async-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side
    def needs(self, version: int) -> bool:
        """Whether some generation batch (past or future, before ``end_batch``) is generated with ``version``
        (``batch_version`` is non-decreasing, so the search stops at the first batch past it); only those versions
        are copied."""
        batch = 0
        while self.end_batch is None or batch < self.end_batch:
            needed = self.batch_version(batch)
            if needed >= version:
                return needed == version
            batch += 1
        return False

    def publish(self, version: int, state: dict) -> None:
        """Hand the engine a CPU copy of the weights of ``version`` (the caller copies; see ``needs``)."""
        with self._cv:
            self._published[int(version)] = state
            self._cv.notify_all()

    def submit(self, batch: int, prompts: list, seeds: list) -> int:
        """Queue generation batch ``batch`` (the next index). Returns its version.

        Raises:
            ValueError: batches submitted out of order, or at or past ``end_batch``.
        """
        if batch != self._submitted + 1:
            raise ValueError(f"generation batch {batch} submitted after batch {self._submitted}; submit in order.")
        if self.end_batch is not None and batch >= self.end_batch:
            raise ValueError(f"generation batch {batch} submitted, but the run trains batches < {self.end_batch}.")
        version = self.batch_version(batch)
        with self._cv:
            self._submitted = batch
            self._requests.append((batch, prompts, seeds, version))
            self._cv.notify_all()
        return version

    def take(self, batch: int) -> BatchResult:
        """Wait for batch ``batch``'s result (``trainer_wait_s`` set) and hand it over.

        Raises:
            EngineError: the worker failed (the engine died, hung or failed a request), or no result within the
                engine's timeout plus ``timeout_s``.
            ValueError: ``batch`` was never submitted.
        """
        if batch > self._submitted:
            raise ValueError(f"generation batch {batch} was never submitted (last: {self._submitted}).")
        started = time.monotonic()
        limit = self.timeout_s + getattr(self.engine, "timeout_s", 0.0) * 2
        with self._cv:
            while batch not in self._results and self._error is None:
                if time.monotonic() - started > limit or not self._thread.is_alive():
                    raise EngineError(f"no result for generation batch {batch} after {limit:g} s.\n"
                                      f"{self.engine.log_tail()}")
                self._cv.wait(0.1)
            if batch not in self._results:
                raise EngineError(f"asynchronous generation failed: {self._error}") from self._error
            result = self._results.pop(batch)
        result.trainer_wait_s = time.monotonic() - started
        return result

    def close(self) -> None:
        """Stop the worker (after its current request) and the engine. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.engine.close()  # a request in flight then fails at once instead of running on
        self._thread.join(30.0)
        with self._cv:
            self._published.clear()

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._requests and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    batch, prompts, seeds, version = self._requests[0]
                    waited = time.monotonic()
                    while version not in self._published and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    idle = time.monotonic() - waited
                    state = self._published[version]
                if self.loaded_version != version:
                    self.engine.load(version, state)
                    self.loaded_version = version
                started = time.monotonic()
                ids, log_probs, served = self.engine.generate(batch, prompts, seeds)
                seconds = time.monotonic() - started
                if served != version:
                    raise EngineError(f"the engine served generation batch {batch} at version {served}, but "
                                      f"version {version} was loaded for it.\n{self.engine.log_tail()}")
                with self._cv:
                    self._requests.popleft()
                    self.served.append((batch, served))
                    self._results[batch] = BatchResult(ids, log_probs, served, seconds, idle)
                    still = {v for _, _, _, v in self._requests}
                    for old in [v for v in self._published if v < version and v not in still]:
                        del self._published[old]  # no later batch can need an older version
                    self._cv.notify_all()
        except BaseException as err:  # handed to the trainer at its next take
            if not self._stopping:
                logger.error("asynchronous rollout worker failed: %s", err)
            with self._cv:
                self._error = err
                self._cv.notify_all()

    @property
    def held_versions(self) -> list[int]:
        """The published versions still held (for tests: at most d + 1)."""
        with self._cv:
            return sorted(self._published)


if __name__ == "__main__":  # the engine's child process (``TransformersProcessEngine.start``)
    _engine_main(**json.loads(sys.argv[1]))
