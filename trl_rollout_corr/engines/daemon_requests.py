"""Requests on daemon threads (the asynchronous vLLM engine's HTTP requests, the CPU weight sync's background
POSTs in ``trl_compat``): a ``concurrent.futures.Future`` per call, and nothing that interpreter exit waits for.

Why not a ``ThreadPoolExecutor``: Python joins an executor's worker threads at interpreter exit even after
``shutdown(wait=False)`` (``concurrent.futures.thread._python_exit``), and TRL's ``VLLMClient`` posts without a timeout
(or with the server's own, minutes), so one request stuck on a hung server kept the process alive after the run
ended; and an executor cannot be created or used once interpreter shutdown has begun ("cannot schedule new futures
after interpreter shutdown").
"""

from __future__ import annotations

import concurrent.futures
import threading

__all__ = ["DaemonRequests"]


class DaemonRequests:
    """At most ``concurrency`` requests at once, each on its own daemon thread. Not a ``ThreadPoolExecutor``: Python
    joins an executor's worker threads at interpreter exit even after ``shutdown(wait=False)``, and TRL's client
    sends its requests without a timeout, so one request stuck on a hung server would keep the process alive
    forever. ``submit`` returns a ``concurrent.futures.Future``; after ``shutdown`` nothing new starts. ``name``: the
    threads' name."""

    def __init__(self, concurrency: int, name: str = "rollout-async-http") -> None:
        self._slots = threading.BoundedSemaphore(max(1, int(concurrency)))
        self._closed = False
        self.name = name

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            with self._slots:
                if self._closed or not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                    future.set_exception(err)

        threading.Thread(target=run, name=self.name, daemon=True).start()
        return future

    def shutdown(self) -> None:
        self._closed = True

