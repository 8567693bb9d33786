"""Sharded-backend worker for ``tests/e2e/test_sharded.py`` (not collected by pytest).

Recipe (CPU, 2 ranks over gloo)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        tests/helpers/dist_sharded_worker.py OUT.json MODEL_DIR BACKEND CASE[,CASE...]

``BACKEND``: ``ddp`` (also the 1-rank reference), ``zero3`` (DeepSpeed ZeRO-3, ``stage3_param_persistence_threshold``
0 so that every parameter of the tiny model is really sharded), ``fsdp2`` (torch FSDP2 ``fully_shard``) or ``fsdp1``
(torch FSDP1, one ``FlatParameter`` per wrapped unit; started as FSDP2 is).
Each rank writes ``OUT.json.rank<k>``: per case, the logged loss, grad_norm and every ``rollout_corr/*`` value of each
step, the trainer's forward counts, and whether a parameter of this rank is partial (``sharded``), or the refusal
(``refused``: the error text) when the trainer refuses the case at construction.

The rows are a fixed rollout table (``TableRollout``): each prompt's completions and behaviour log-probs are a
function of the prompt text only, so 1 rank and 2 ranks train on the same rows whatever the backend generates with.

How each backend is started on CPU (recipes/accelerate/CPU_MULTI_RANK.md):

* ZeRO-3: ``deepspeed.init_distributed(dist_backend="gloo")`` before the trainer (with ``use_cpu=True`` and a
  ``deepspeed=`` dict accelerate never starts DeepSpeed's communication, and ``zero.Init`` then sees world size 1).
* FSDP2: accelerate 1.15 keeps an FSDP plugin only on an accelerator device type (``MULTI_GPU``, ...): with
  ``use_cpu=True`` it silently drops it and runs DDP. ``cpu_fsdp_state`` starts accelerate's shared state as
  MULTI_CPU over gloo, then lets ``AcceleratorState`` see ``MULTI_GPU`` while it keeps the plugin (the device stays
  ``cpu``), so that the Trainer's ``prepare`` calls accelerate's own ``fully_shard`` path. Test harness only:
  accelerate offers no supported way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import zlib

import torch

from dist_teardown import run_and_tear_down  # tests/ is on sys.path: this file runs as a script from there
from tiny_model import prompt_dataset, reward_len
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
}
FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}}
FSDP1 = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1}}

# case -> RolloutCorrGRPOConfig fields (the rollout table's versions: "stale" rows on rank 0 only)
CASES = {
    "none": {},
    "decoupled": dict(rollout_corr_preset="decoupled_token_is", rollout_rs="token_k1", rollout_rs_threshold="0.3_3.0"),
    "bypass": dict(rollout_corr_preset="bypass_pg_is"),
    "policy_lag_split": dict(rollout_corr_preset="decoupled_token_is", policy_lag_split=True),
    # with accumulation 2 (per_device_train_batch_size 2 on 2 ranks): rank 0's 4 stale rows are 2 version chunks,
    # rank 1 has none (it joins with 2 placeholder forwards; 1 before the fix: a hang)
    "policy_lag_split_accum": dict(rollout_corr_preset="decoupled_token_is", policy_lag_split=True,
                                   gradient_accumulation_steps=2),
    "support_recompute": dict(rollout_corr_preset="decoupled_token_is", rollout_support_matching="recompute"),
    "max_policy_lag": dict(rollout_corr_preset="decoupled_token_is", max_policy_lag=0),  # rank 0's stale rows dropped
    "records": dict(rollout_corr_preset="decoupled_token_is"),  # + rollout_dump_dir (set in run_case)
    # bypass + batch normalisation with gradient accumulation: the batch-norm window forward (once per step)
    "bypass_bn_window": dict(rollout_corr_preset="bypass_pg_is", rollout_is_batch_normalize=True,
                             gradient_accumulation_steps=2),
    # the plain transformers.generate path (no rollout_func) with a correction on: mu captured from generate
    "plain_generate": dict(rollout_corr_preset="decoupled_token_is"),
    # fsdp= on CPU ranks without the harness's cpu_fsdp_state: accelerate drops it (last in the fsdp2 launch only)
    "fsdp_dropped": dict(rollout_corr_preset="decoupled_token_is"),
}


class TableRollout:
    """``rollout_func(prompts, trainer)``: a fixed table. Each prompt's completion (1-7 tokens of the tiny model's
    vocabulary, EOS-terminated on some) and behaviour log-probs (in [-4.3, -3.3], near the tiny model's uniform
    -3.76) come from a generator seeded with the prompt text, its repeat index and the step, so the rows do not
    depend on the model, the backend or the number of ranks. With ``stale`` the rows report ``policy_version`` =
    step - 1 (from step 1 on) for the prompts of rank 0 only: rows that differ between ranks."""

    def __init__(self, top_p: float = 1.0, stale: bool = False):
        self.stale = stale
        self.seen: dict[str, int] = {}
        if top_p < 1.0:
            from trl_rollout_corr.support import sampler_from_vllm_params

            self.sampler_contract = lambda trainer: sampler_from_vllm_params({"top_p": top_p})

    def __call__(self, prompts, trainer):
        tok = trainer.processing_class
        step = int(trainer.state.global_step)
        rank = trainer.accelerator.process_index
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "policy_version": []}
        counts: dict[str, int] = {}
        for text in prompts:
            k = counts[text] = counts.get(text, -1) + 1
            g = torch.Generator().manual_seed(zlib.crc32(f"{text}|{k}|{step}".encode()))
            n = int(torch.randint(1, 8, (1,), generator=g))
            ids = torch.randint(3, 40, (n,), generator=g).tolist()
            if n < 7 and int(torch.randint(0, 2, (1,), generator=g)):
                ids[-1] = tok.eos_token_id
            out["prompt_ids"].append(tok(text=text)["input_ids"])
            out["completion_ids"].append(ids)
            out["logprobs"].append((-3.3 - 1.0 * torch.rand(n, generator=g)).tolist())
            stale = self.stale and step > 0 and (rank == 0 if trainer.accelerator.num_processes > 1 else
                                                 self._first_half(text))
            out["policy_version"].append(step - 1 if stale else step)
        return out

    @staticmethod
    def _first_half(text: str) -> bool:
        """1 rank: the prompts rank 0 holds with 2 ranks (the first half of the dataset's order, see main)."""
        return int(text.split("+")[0]) % 2 == 0


@contextlib.contextmanager
def cpu_fsdp_state():
    """Start accelerate's state so that an FSDP plugin survives on CPU ranks (module docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)  # gloo process group, device cpu, MULTI_CPU
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    yield


def param_is_partial(trainer) -> dict:
    """Whether this rank holds only part of a parameter: the LM head / embedding weight's local numel vs full."""
    model = trainer.model_wrapped
    for module in model.modules():  # FSDP1: this rank's (padded) part of the first FlatParameter
        flat = getattr(module, "_flat_param", None)
        if flat is not None:
            return {"name": "_flat_param", "local": int(flat._local_shard.numel()),
                    "full": int(flat._unpadded_unsharded_size.numel())}
    for name, p in model.named_parameters():
        if getattr(p, "ds_tensor", None) is not None:  # ZeRO-3: p is empty outside a gather, ds_tensor the shard
            return {"name": name, "local": int(p.ds_tensor.numel()), "full": int(p.ds_numel)}
        local = getattr(p, "to_local", None)
        if local is not None:  # FSDP2: a DTensor
            return {"name": name, "local": int(p.to_local().numel()), "full": int(p.numel())}
        return {"name": name, "local": int(p.numel()), "full": int(p.numel())}
    raise AssertionError("no parameter")


def run_case(case: str, backend: str, model_dir: str, work: str, world: int) -> dict:
    fields = dict(CASES[case])
    if case == "records":
        fields["rollout_dump_dir"] = os.path.join(work, f"records_{case}")
    rollout = TableRollout(top_p=0.9 if case == "support_recompute" else 1.0,
                           stale=case in ("policy_lag_split", "policy_lag_split_accum", "max_policy_lag"))
    accumulation = fields.get("gradient_accumulation_steps", 1)
    kwargs = dict(
        output_dir=os.path.join(work, case), use_cpu=True, per_device_train_batch_size=8 // world // accumulation,
        num_generations=4, max_completion_length=8, max_steps=3, logging_steps=1, report_to=[], save_strategy="no",
        learning_rate=1e-3, beta=0.0, seed=0, disable_tqdm=True, bf16=False, shuffle_dataset=False,
        top_p=0.9 if case == "support_recompute" else 1.0, **fields,
    )
    if case == "fsdp_dropped":
        kwargs.update(FSDP2)
    elif backend == "zero3":
        kwargs["deepspeed"] = ZERO3
    elif backend in ("fsdp2", "fsdp1"):
        kwargs.update(FSDP2 if backend == "fsdp2" else FSDP1, accelerator_config={"use_configured_state": True})
    if case == "plain_generate":
        rollout = None
        kwargs["max_steps"] = 1
    try:
        trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(8),
                                         rollout_func=rollout, args=RolloutCorrGRPOConfig(**kwargs))
    except (ValueError, NotImplementedError) as err:
        return {"refused": f"{type(err).__name__}: {err}"}
    # every forward of the policy's top module on this rank (TRL's and ours), by grad mode: the rule of
    # docs/explanation/architecture.md is that they are the same on every rank
    calls = {"grad": 0, "no_grad": 0}

    def count(module, args):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    model = trainer.accelerator.unwrap_model(trainer.model)
    handle = model.register_forward_pre_hook(count)
    trainer.train()
    handle.remove()
    logs = [{k: v for k, v in h.items() if k in ("loss", "grad_norm") or k.startswith("rollout_corr/")}
            for h in trainer.state.log_history if "loss" in h]
    out = {"logs": logs, "forwards": dict(trainer.rollout_corr_forward_counts), "model_calls": calls,
           "sharded": param_is_partial(trainer), "distributed_type": str(trainer.accelerator.distributed_type),
           "wrapped": type(trainer.model_wrapped).__name__}
    if case == "policy_lag_split":
        out["lag_split_memory"] = lag_split_memory(trainer)
    return out


def lag_split_memory(trainer) -> dict:
    """What ``policy_lag_split`` holds on this rank at the end: bytes per kept version (by version), the full
    parameters' bytes, and this rank's live shard bytes (ZeRO-3 ``ds_tensor``, FSDP2 local shard, else whole)."""
    from trl_rollout_corr import trl_compat
    from trl_rollout_corr.features import LagSplit
    from trl_rollout_corr.version_store import _local_shard

    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        shard = sum(_local_shard(p).numel() * _local_shard(p).element_size() for p in model.parameters())
    kept = trainer.rollout_corr_features.get(LagSplit).kept_bytes()
    return {"per_version": {str(v): b for v, b in kept.items()}, "rank_shard_bytes": int(shard),
            "full_bytes": trl_compat.full_parameter_bytes(model, trainer.accelerator.num_processes),
            "store": type(trainer.rollout_corr_features.get(LagSplit).store).__name__}


def main() -> None:
    out_path, model_dir, backend, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    torch.set_num_threads(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    stack = contextlib.ExitStack()
    if backend in ("fsdp2", "fsdp1"):
        stack.enter_context(cpu_fsdp_state())
    result = {"world": world, "backend": backend, "cases": {}}
    with stack:
        for case in cases:
            start = time.perf_counter()
            result["cases"][case] = run_case(case, backend, model_dir, os.path.dirname(out_path), world)
            result["cases"][case]["seconds"] = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_and_tear_down(main)
