"""Record a ``rollout_func``'s outputs once and replay them in another cell of an experiment (a benchmark device).

Why: in the policy-lag experiment a cell whose sync interval k is at least its number of optimizer steps never
syncs the vLLM engine after the first call, so every one of its rollouts comes from the shared warm start's weights,
and the rollouts of two cells with the same seed are the same whatever the method trains (measured: at k = 32 the
plain-TRL and TIS cells of a seed logged identical rewards and lengths at every step). vLLM CPU generation is about
60 % of such a cell's time. ``RecordedRollout`` saves each call's output in the first such cell of a seed and
returns it, unchanged, in the later ones.

Exactness: a replayed call is checked against the recorded one (the optimizer step, a SHA-256 of the prompts and
the prompt ids the rollout's tokenizer gives them, the sampling keyword arguments and engine description, the
machine (torch version, CPU model and capability, thread count), at the first call a SHA-256 of the trainer's
weights (the ones the engine samples with when it is never synced again), and a digest of Python's, NumPy's and
torch's global random states before the call) and raises ``RuntimeError`` (its message starts with ``MISMATCH``) on
any difference; then it restores the three random states
the recorded run had *after* the call (in-process vLLM may draw from them; TRL then shuffles the generation batch
with the global torch generator), so the training continues exactly as it would have. Floats are stored as JSON
numbers (Python's shortest round-trip repr: exact). ``benchmarks/policy_lag_experiment.py``'s report compares
every replayed cell's per-step rewards and completion lengths with the generated cells of its seed.

File: ``rollouts.json.gz``, ``{"format": 2, "calls": [{"call", "step", "prompts_sha256", "sampling", "machine",
"weights_sha256" (call 0; else null), "rng_before", "rng_after", "output"}, ...]}``, rewritten atomically after
every call (a killed run leaves a readable prefix).
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

FORMAT = 2
MISMATCH = "rollout replay mismatch"  # starts every RuntimeError of a replay that cannot go on (run_cell looks for it)
CHECKED = ("step", "prompts_sha256", "sampling", "machine", "weights_sha256", "rng_before")


def _rng_states() -> dict:
    """Python's, NumPy's and torch's global random states, JSON-able (torch's as base64 of its byte tensor)."""
    import numpy as np
    import torch

    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss],
            "numpy": [name, [int(x) for x in keys], int(pos), int(has_gauss), float(cached)],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_states(s: dict) -> None:
    import numpy as np
    import torch

    version, state, gauss = s["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch"])), dtype=torch.uint8).clone())


def machine() -> dict:
    """What, besides the code and the weights, decides the engine's samples: torch's version, the CPU's model and
    capability (its kernels), the thread count."""
    import platform

    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def weights_sha256(trainer: Any) -> str:
    """SHA-256 over the trainer's model parameters and buffers (name, dtype, shape, bytes; in name order)."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def load_recording(path: Path) -> list[dict]:
    """The recorded calls of ``path`` (``rollouts.json.gz``), in call order.

    Raises:
        ValueError: not a recording of this format.
    """
    data = json.loads(gzip.decompress(Path(path).read_bytes()))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a rollout recording of format {FORMAT}; record it again.")
    return data["calls"]


class RecordedRollout:
    """Wraps a ``rollout_func`` (TRL's ``rollout_func(prompts, trainer) -> dict`` contract) to record or replay it.

    Args:
        rollout: the real ``rollout_func`` (``VLLMCPURollout``); other attributes (``describe``,
            ``sampler_contract``, ...) are delegated to it.
        path: the recording (``rollouts.json.gz``): written in ``"record"`` mode, read in ``"replay"`` mode.
        mode: ``"record"`` (call the real rollout, save its output and the random states) or ``"replay"`` (return the
            recorded outputs without generating).

    Attributes:
        calls: the calls recorded so far (record; None once stopped) or the recording (replay); ``replayed``: calls
            served from it; ``stopped``: why recording stopped (None while it records).

    Raises:
        ValueError: an unknown ``mode``; ``FileNotFoundError``: replay of a missing file.
        RuntimeError (at a call, replay): the recording has fewer calls, or the call differs from the recorded one
            (step, prompts, prompt ids, sampling, machine, weights at the first call, random state before it); the
            message starts with ``MISMATCH`` and names what differs.
    """

    def __init__(self, rollout: Any, path: str | os.PathLike, mode: str):
        if mode not in ("record", "replay"):
            raise ValueError(f"mode must be 'record' or 'replay', not {mode!r}")
        self.rollout, self.path, self.mode, self.replayed = rollout, Path(path), mode, 0
        self.calls: list[dict] | None = load_recording(self.path) if mode == "replay" else []
        self._n, self.stopped = 0, None
        self._machine = machine()  # fixed for the process: read once, not at every call

    def __getattr__(self, name: str) -> Any:
        if name == "rollout":  # not yet set (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.rollout, name)

    def _record(self, entry: dict) -> None:
        """Append one call and rewrite the file; an output that JSON does not return unchanged (tuples, NumPy
        scalars) stops the recording (file removed, ``stopped`` says why) and never the run it observes."""
        try:
            text = json.dumps(entry)
            if json.loads(text)["output"] != entry["output"] or any(
                    type(v) is not list for v in entry["output"].values()):
                raise TypeError("the output does not survive a JSON round trip unchanged")
        except (TypeError, ValueError) as err:
            self.calls, self.stopped = None, f"call {entry['call']}: {err}"
            self.path.unlink(missing_ok=True)
            print(f"[rollout_replay] recording stopped ({self.stopped}); the run goes on", flush=True)
            return
        self.calls.append(json.loads(text))  # a copy: a later in-place change of the returned output cannot alter it
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(gzip.compress(json.dumps({"format": FORMAT, "calls": self.calls}).encode(), mtime=0))
        tmp.replace(self.path)

    def _sampling(self, trainer: Any) -> dict:
        kwargs = getattr(self.rollout, "sampling_kwargs", None)
        describe = getattr(self.rollout, "describe", None)
        return json.loads(json.dumps({"sampling_kwargs": kwargs(trainer) if kwargs else None,
                                      "engine": describe() if describe else None}, sort_keys=True, default=str))

    def __call__(self, prompts: list, trainer: Any) -> dict:
        key = {"call": self._n, "step": int(trainer.state.global_step), "prompts_sha256": _digest(prompts),
               "sampling": self._sampling(trainer), "machine": self._machine,
               "weights_sha256": weights_sha256(trainer) if self._n == 0 else None,
               "rng_before": _digest(_rng_states())}
        self._n += 1
        if self.mode == "record":
            output = self.rollout(prompts, trainer)
            if self.calls is not None:
                self._record({**key, "rng_after": _rng_states(), "output": output})
            return output
        if key["call"] >= len(self.calls):
            raise RuntimeError(f"{MISMATCH}: {self.path} holds {len(self.calls)} rollout calls; call {key['call']} "
                               f"(step {key['step']}) was not recorded: replay only a run at most as long as the "
                               "recorded one.")
        rec = self.calls[key["call"]]
        differ = {f: (rec.get(f), key[f]) for f in CHECKED if rec.get(f) != key[f]}
        tokenize = getattr(self.rollout, "tokenize", None)
        if not differ and tokenize is not None:
            ids = tokenize(prompts, trainer)
            if ids != rec["output"].get("prompt_ids"):  # the same messages, tokenised otherwise (template, version)
                differ["prompt_ids"] = (rec["output"].get("prompt_ids"), ids)
        if differ:
            raise RuntimeError(
                f"{MISMATCH}: rollout call {key['call']} differs from {self.path} in {list(differ)} (recorded, now: "
                f"{differ}): this run would not have sampled the recorded completions; run it without replay.")
        _set_rng_states(rec["rng_after"])
        self.replayed += 1
        return copy.deepcopy(rec["output"])
