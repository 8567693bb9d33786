"""``run_torchrun``: a multi-rank test worker under ``torch.distributed.run`` that leaves no process behind (not
collected).

``subprocess.run(..., timeout=)`` kills only torchrun on a timeout, and torchrun starts each rank in a session of its
own, so after a hang (a collective some rank never joins) the ranks kept running, holding a core each. Here the
whole tree (torchrun and every descendant, found with psutil before anything is killed) is killed on a timeout and
on any other way out of the wait, then the timeout is raised.
"""

from __future__ import annotations

import subprocess

import psutil


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (descendants listed first, so none is re-parented out of reach)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_torchrun(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)``, except that on a timeout
    (``subprocess.TimeoutExpired`` raised, as there) or an interrupt every process of the tree is killed first."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
