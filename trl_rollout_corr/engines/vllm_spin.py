"""How long a vLLM CPU server's processes busy-wait for a message before they sleep: the one coupling to vLLM's
shared-memory queue (``vllm.distributed.device_communicators.shm_broadcast.SpinCondition``, vLLM 0.32).

vLLM CPU runs its worker in a process of its own (``platforms/cpu.py`` turns the ``uni`` executor into ``mp`` unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the engine core and the worker exchange every scheduler step through
``shm_broadcast.MessageQueue``. A reader of that queue spins (``sched_yield`` in a loop) for ``SpinCondition``'s
``busy_loop_s`` seconds after its last read (vLLM's default: 1 s) before it waits on a ZeroMQ notification instead.
While the worker generates, the engine core reads a message every decode step, so it never stops spinning: a server
started with one OpenMP thread keeps a second core busy doing nothing. On a GPU machine that core is spare; on a CPU
machine it is the trainer's (TRL's server mode and the asynchronous pipeline put the server beside the trainer on
the same cores).

``SPIN_ENV`` (``TRL_ROLLOUT_CORR_VLLM_SPIN_S``, seconds, >= 0) sets that default in every process of a server started
with this package installed: the ``vllm.general_plugins`` entry point (``vllm_weight_sync.register``) calls
``apply_from_env`` in each process vLLM starts, before it builds its queues. Unset: vLLM's default, unchanged.
``vllm_serve.server_env`` sets it to ``"0"`` for a CPU server (``trl-rollout-corr vllm-serve``, ``VLLMServer``)
unless the caller set it (an empty value: vLLM's default): every wait is then a ZeroMQ poll, woken by the writer's
notification (the writer notifies after every message, ``MessageQueue.enqueue``), the path vLLM itself takes after
1 s without a message. A notification can be dropped (the writer's PUB socket has a send high-water mark of 1); the
reader then finds the message at vLLM's periodic re-check of the shared flag (``SHM_READER_RECHECK_INTERVAL_MS``,
5 s), so a lost wake-up delays one step by up to 5 s and never hangs. The per-message cost of a poll is not measured
on its own; ``benchmarks/bench_vllm_spin.py`` measures cores and generate seconds of both settings (RESULTS.md, V4:
no slowdown seen in 2 pairs, not established). The writer side is unchanged (vLLM's writers never wait on the
notification; a writer spins only while the ring buffer is full).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from typing import Optional

SPIN_ENV = "TRL_ROLLOUT_CORR_VLLM_SPIN_S"
CPU_DEFAULT = "0"  # what vllm_serve.server_env sets on CPU unless the caller set SPIN_ENV


def parse_spin(value: str) -> float:
    """``SPIN_ENV``'s value as seconds.

    Raises:
        ValueError: not a finite number >= 0 (names the variable and an example)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{SPIN_ENV}={value!r}: give the seconds a vLLM queue reader busy-waits before it sleeps, "
                         f"a number >= 0 (e.g. {SPIN_ENV}=0; unset for vLLM's default of 1 s).")
    return seconds


def apply(seconds: float) -> float:
    """Make ``seconds`` the default ``busy_loop_s`` of ``SpinCondition`` in this process (the queues built after
    this call use it); returns the previous default.

    Raises:
        ValueError: ``seconds`` < 0 or not finite.
        RuntimeError: vLLM's ``SpinCondition.__init__`` no longer has ``busy_loop_s`` as its last defaulted
            parameter (another vLLM than the pinned 0.32: this coupling must be re-read)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"busy-wait seconds must be finite and >= 0, got {seconds!r}")
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init = SpinCondition.__init__
    params = list(inspect.signature(init).parameters.values())
    if not params or params[-1].name != "busy_loop_s" or not init.__defaults__:
        raise RuntimeError(
            "vllm.distributed.device_communicators.shm_broadcast.SpinCondition.__init__ has no trailing "
            f"busy_loop_s parameter in this vLLM ({[p.name for p in params]}); trl_rollout_corr.engines.vllm_spin "
            f"was written for vLLM 0.32: set {SPIN_ENV}= (empty) to run without it (unset, a CPU server gets "
            f"{CPU_DEFAULT!r} from vllm_serve.server_env), and report the version.")
    previous = init.__defaults__[-1]
    init.__defaults__ = (*init.__defaults__[:-1], float(seconds))
    return float(previous)


def apply_from_env(environ: Optional[dict] = None) -> Optional[float]:
    """``apply(SPIN_ENV's seconds)`` when the variable is set (returns the seconds, and says so on stderr with this
    process's id: the server log shows one line per vLLM process), else nothing (None).

    Raises:
        ValueError: as ``parse_spin``. RuntimeError: as ``apply``."""
    value = (os.environ if environ is None else environ).get(SPIN_ENV)
    if value is None or value == "":
        return None
    seconds = parse_spin(value)
    previous = apply(seconds)
    print(f"trl_rollout_corr: vLLM queue readers busy-wait {seconds:g} s (was {previous:g} s; {SPIN_ENV}) "
          f"in pid {os.getpid()}", file=sys.stderr, flush=True)
    return seconds
