"""``torchrun.run_torchrun`` kills the whole tree on a timeout, also a descendant in a session of its own (as
torchrun starts its ranks); ``subprocess.run(timeout=)`` left such a rank running after a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from torchrun import run_torchrun

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_timeout_kills_a_descendant_in_its_own_session(tmp_path):
    out = tmp_path / "pid"
    script = PARENT.replace("print(child.pid, flush=True)", f"open({str(out)!r}, 'w').write(str(child.pid))")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun([sys.executable, "-c", script], dict(os.environ), timeout=3)
    assert time.monotonic() - started < 30
    child = int(out.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_finished_run_returns_its_output():
    proc = run_torchrun([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                        dict(os.environ), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "out\n", "err\n")
