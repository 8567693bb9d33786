"""The CPU weight sync's pieces without vLLM: the chunk plan, a real two-rank gloo broadcast of mixed dtypes, the
``vllm-serve`` command built from TRL's, the CLI's refusals, and the ``VLLMClient`` hook's dispatch (TRL's own
methods for a non-CPU device; the gloo path and its errors on CPU). The real server is in
``tests/e2e/test_trl_vllm_server.py``."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch

from trl_rollout_corr.engines.vllm_weight_sync import (
    BACKEND,
    GlooChannel,
    plan_chunks,
    receive_tensors,
    send_tensors,
    tensor_nbytes,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_chunks_by_hand():
    assert plan_chunks([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_chunks([10, 1, 1], 8) == [[0], [1, 2]]  # a tensor over the limit travels alone
    assert plan_chunks([3, 5, 8, 1], 8) == [[0, 1], [2], [3]]
    assert plan_chunks([], 8) == []
    with pytest.raises(ValueError, match="positive"):
        plan_chunks([1], 0)
    assert tensor_nbytes("bfloat16", [3, 5]) == 30 and tensor_nbytes("torch.float32", [2]) == 8
    with pytest.raises(ValueError, match="not a torch dtype"):
        tensor_nbytes("float33", [1])


def test_gloo_broadcast_round_trip_is_bit_exact_across_chunks():
    gen = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(5, 3, generator=gen)), ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
               ("c", torch.randint(0, 100, (4, 2), generator=gen)), ("d", torch.randn(33, generator=gen))]
    tensors.append(("e", torch.randn(4, 6, generator=gen).t()))  # non-contiguous: sent as its contiguous copy
    meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
    port, chunk = _free_port(), 64  # bytes: several chunks, "d" (132 B) alone
    assert len(plan_chunks([tensor_nbytes(d, s) for _, d, s in meta], chunk)) >= 4
    received, errors = [], []

    def worker():
        try:
            ch = GlooChannel("127.0.0.1", port, 1, 2, timeout_s=30)
            names, dtypes, shapes = zip(*meta)
            for part in receive_tensors(ch, names, dtypes, shapes, chunk):
                received.extend((n, t.clone()) for n, t in part)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    channel = GlooChannel("127.0.0.1", port, 0, 2, timeout_s=30)
    sent = send_tensors(channel, meta, iter(tensors), chunk)
    thread.join(60)
    assert not errors and not thread.is_alive()
    assert sent == sum(t.numel() * t.element_size() for _, t in tensors)
    assert [n for n, _ in received] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, received):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    channel.close()


def test_send_refuses_a_tensor_unlike_its_announcement_before_sending():
    class NoWire:
        def broadcast(self, t):
            raise AssertionError("nothing may be sent")

    with pytest.raises(ValueError, match="'a' float32 \\[2\\] was announced"):
        send_tensors(NoWire(), [("a", "float32", [2])], [("a", torch.zeros(3))])
    with pytest.raises(ValueError, match="only 0 were given"):
        send_tensors(NoWire(), [("a", "float32", [2])], [])


def test_gloo_channel_names_the_address_when_the_port_is_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"{BACKEND}: rank 0 of 2 .* 127.0.0.1:{port}"):
            GlooChannel("127.0.0.1", port, 0, 2, timeout_s=2)


# ------------------------------------------------------------------------------------------ the server command
def _script_args(**kw):
    from trl.scripts.vllm_serve import ScriptArguments

    return ScriptArguments(**{"model": "/", "dtype": "float32", **kw})


def test_server_command_is_trls_with_the_cpu_backend_launcher_and_eager():
    from trl.scripts.vllm_serve import build_command

    from trl_rollout_corr.engines.vllm_serve import LAUNCHER, VLLM_CLI, server_command

    trl = build_command(_script_args(), ["--seed", "3"])
    gpu = server_command(_script_args(), ["--seed", "3"], cpu=False)
    assert gpu == trl  # with CUDA: TRL's command, unchanged (nccl)
    cpu = server_command(_script_args(), ["--seed", "3"], cpu=True)
    assert cpu[cpu.index("-m") + 1] == LAUNCHER and VLLM_CLI not in cpu
    assert json.loads(cpu[cpu.index("--weight-transfer-config") + 1]) == {"backend": BACKEND}
    assert "--enforce-eager" in cpu and cpu[-2:] == ["--seed", "3"]
    assert "processed_logprobs" in cpu  # TRL's settings kept
    explicit = server_command(_script_args(enforce_eager=False), [], cpu=True, eager_given=True)
    assert "--enforce-eager" not in explicit


def test_server_command_refusals_name_the_fix(tmp_path, monkeypatch):
    from trl_rollout_corr.engines.vllm_serve import server_command

    with pytest.raises(ValueError, match="--dtype bfloat16 or --dtype float32"):
        server_command(_script_args(dtype="auto"), [], cpu=True)
    server_command(_script_args(dtype="auto"), [], cpu=False)  # TRL's default stays on CUDA
    with pytest.raises(ValueError, match="no such directory"):
        server_command(_script_args(model=str(tmp_path / "missing")), [], cpu=True)
    server_command(_script_args(model="Org/name"), [], cpu=True)  # a Hub id is left to vLLM
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ValueError, match="no such directory"):  # models/X next to a models/ folder: a local path
        server_command(_script_args(model="models/SmolLM3"), [], cpu=True)
    with pytest.raises(ValueError, match="remove it"):
        server_command(_script_args(), ["--weight-transfer-config", "{}"], cpu=True)


def test_cli_vllm_serve_exits_2_on_missing_model_and_busy_port(tmp_path, capsys):
    from trl_rollout_corr.cli import main

    assert main(["vllm-serve", "--model", str(tmp_path / "nope"), "--dtype", "float32"]) == 2
    assert "no such directory" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["vllm-serve", "--model", str(tmp_path), "--dtype", "float32", "--host", "127.0.0.1",
                     "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_vllm_server_timeout_names_the_flag_and_leaves_nothing_running(tmp_path, monkeypatch):
    import sys

    from trl_rollout_corr.engines import vllm_serve

    srv = vllm_serve.VLLMServer(str(tmp_path), "float32", timeout_s=2, log_path=str(tmp_path / "log"),
                                timeout_flag="--vllm_server_timeout")
    monkeypatch.setattr(srv, "command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(TimeoutError, match="raise --vllm_server_timeout"):
        srv.start()
    assert srv.process is None  # stopped (process group killed)
    srv2 = vllm_serve.VLLMServer(str(tmp_path), "float32", timeout_s=30, log_path=str(tmp_path / "log2"))
    monkeypatch.setattr(srv2, "command", lambda: [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*boom"):
        srv2.start()


# ------------------------------------------------------------------------------------------ the client hook
class FakeServerClient:
    """Stands in for a reachable server: ``get_server_info`` / ``get_world_size`` only (the dispatch under test)."""

    def __init__(self, backend):
        self.backend, self.base_url, self.host, self.group_port = backend, "http://127.0.0.1:1", "127.0.0.1", 1
        self.communicator = None

    def get_server_info(self):
        return {"weight_transfer_config": None if self.backend is None else {"backend": self.backend}}

    def _get(self, url, **kw):
        raise ConnectionError("no server")


def test_client_hook_dispatches_on_the_device():
    from trl.generation.vllm_client import VLLMClient

    from trl_rollout_corr import trl_compat

    trl_compat.install_vllm_client_cpu_weight_sync()
    assert trl_compat.install_vllm_client_cpu_weight_sync() is False  # idempotent
    # not CPU: TRL's own method runs (its message names TRL's nccl flag)
    with pytest.raises(RuntimeError, match='"backend": "nccl"'):
        VLLMClient.init_communicator(FakeServerClient(None), device="cuda:0")
    # CPU against a server with another backend: our error, naming the command that starts the right server
    with pytest.raises(RuntimeError, match="backend 'nccl'.*trl-rollout-corr vllm-serve"):
        VLLMClient.init_communicator(FakeServerClient("nccl"), device=torch.device("cpu"))
    # a TRL communicator is closed by TRL's method; ours by ours
    fake = FakeServerClient(BACKEND)
    fake.communicator = GlooChannel.__new__(GlooChannel)
    fake.communicator.group = fake.communicator.store = object()
    VLLMClient.close_communicator(fake)
    assert fake.communicator is None


def test_the_cpu_server_env_turns_the_queue_spin_off_unless_set():
    """``server_env``: on CPU ``TRL_ROLLOUT_CORR_VLLM_SPIN_S=0`` (the engine core's busy-wait on its worker,
    ``engines/vllm_spin.py``) unless the caller set it; on CUDA vLLM's default (nothing set)."""
    from trl_rollout_corr.engines.vllm_serve import server_env
    from trl_rollout_corr.engines.vllm_spin import SPIN_ENV

    assert SPIN_ENV == "TRL_ROLLOUT_CORR_VLLM_SPIN_S"
    assert server_env(True, {})[SPIN_ENV] == "0" and server_env(True, {})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server_env(True, {SPIN_ENV: "0.5"})[SPIN_ENV] == "0.5"
    assert SPIN_ENV not in server_env(False, {}) and server_env(False, {})["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_spin_setting_is_parsed_or_refused_with_the_fix():
    from trl_rollout_corr.engines.vllm_spin import apply, apply_from_env, parse_spin

    assert parse_spin("0") == 0.0 and parse_spin("0.25") == 0.25
    for bad in ("-1", "nan", "inf", "fast", ""):
        with pytest.raises(ValueError, match="TRL_ROLLOUT_CORR_VLLM_SPIN_S=0"):
            parse_spin(bad)
    assert apply_from_env({}) is None and apply_from_env({"TRL_ROLLOUT_CORR_VLLM_SPIN_S": ""}) is None  # vLLM's own
    with pytest.raises(ValueError, match="a number >= 0"):
        apply_from_env({"TRL_ROLLOUT_CORR_VLLM_SPIN_S": "-0.5"})  # refused before vLLM is imported
    with pytest.raises(ValueError, match="finite and >= 0"):
        apply(-1.0)


def test_the_spin_coupling_names_an_opt_out_that_server_env_keeps(monkeypatch):
    """Another vLLM whose ``SpinCondition.__init__`` has no trailing ``busy_loop_s``: ``apply`` refuses, and the fix
    it names must work for a CPU server too, where ``server_env`` sets ``"0"`` whenever the variable is unset (so
    "unset it" would not help); an empty value is kept by ``server_env`` and skipped by the plugin. With the pinned
    signature the default is rewritten (1 -> 0.25) and the previous one returned."""
    import sys
    import types

    from trl_rollout_corr.engines.vllm_serve import server_env
    from trl_rollout_corr.engines.vllm_spin import SPIN_ENV, apply, apply_from_env

    class Renamed:
        def __init__(self, is_reader, context, notify_address, spin_s: float = 1):
            pass

    class Pinned:
        def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
            self.busy_loop_s = busy_loop_s

    fake = types.ModuleType("shm_broadcast")
    for name in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.shm_broadcast", fake)
    fake.SpinCondition = Renamed
    with pytest.raises(RuntimeError, match=f"set {SPIN_ENV}= \\(empty\\) to run without it") as err:
        apply(0.0)
    assert f"unset {SPIN_ENV} to run" not in str(err.value)
    assert server_env(True, {SPIN_ENV: ""})[SPIN_ENV] == "" and apply_from_env({SPIN_ENV: ""}) is None
    fake.SpinCondition = Pinned
    assert apply(0.25) == 1.0 and Pinned(True, None, "x").busy_loop_s == 0.25
    assert Pinned(True, None, "x", 2.0).busy_loop_s == 2.0  # an explicit value still wins
