"""A server ``VLLMServer`` started dies with the process that started it, even when that process is SIGKILLed (the
OOM killer ended a test process and left its two vLLM servers running): ``vllm_launch.watch_parent``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

# the parent starts the watched child (in a session of its own, as VLLMServer does) and passes its own pid, as
# VLLMServer does through TRL_ROLLOUT_CORR_WATCH_PARENT; the child says when its watch runs
PARENT = """
import os, subprocess, sys, time
code = ("import sys, time; from trl_rollout_corr.engines.vllm_launch import watch_parent; "
        "watch_parent(int(sys.argv[1]), poll_s=0.1, grace_s=1.0); open(sys.argv[2], 'w').write('watching'); "
        "time.sleep(120)")
child = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), sys.argv[2]], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a dead orphan waits there for init to reap it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text()


def test_the_watched_process_group_dies_with_its_parent(tmp_path):
    pid_file, ready = tmp_path / "pid", tmp_path / "ready"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), str(ready)], env=dict(os.environ))
    child = psutil.Process(int(_wait_for(pid_file, 30)))
    try:
        assert _wait_for(ready, 60) == "watching"
        time.sleep(0.5)
        assert _alive(child)  # the watch leaves it alone while its parent lives
        parent.kill()  # SIGKILL: no cleanup code of the parent runs
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the watched child outlived its parent"
    finally:
        parent.kill()
        if _alive(child):
            child.kill()
