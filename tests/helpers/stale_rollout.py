"""A stale rollout engine for the policy-lag tests: ``transformers.generate`` from a copy of the policy that takes
the trainer's weights on ``lag.WeightSchedule`` (every ``sync_interval`` steps, or ``async_depth`` steps behind),
float32 like the trainer, so its log-probs differ from the trainer's only by staleness.

It records the ground truth: for every generated row, the version (optimizer step) of the weights that really
generated it, keyed by (prompt ids, completion ids), so a test can check the version each row carries into the
loss against what generated it (not against the trainer's own bookkeeping).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs
from trl_rollout_corr.lag import WeightSchedule
from trl_rollout_corr.routing import find_moe_routers, record_routes


class StaleRollout:
    """``rollout_func(prompts, trainer)`` with stale weights; see the module docstring.

    Args:
        sync_interval, async_depth: the ``WeightSchedule``.
        report: "version" (return ``policy_version``), "none" (return no version), "future" (report one step
            ahead of the trainer: a bad engine), "per_token" (one version per token) or "per_token_short" (one
            version fewer than the completion's tokens: a bad engine).
        max_new_tokens: completion length bound.
        top_p: the engine's nucleus (< 1: it declares the sampler contract ``top_p`` for support matching).
        routes: record the engine's MoE routes and return them as ``routed_experts`` (for ``routing_replay='r3'``).
    """

    def __init__(self, sync_interval: int = 1, async_depth: int = 0, report: str = "version", max_new_tokens=8,
                 top_p: float = 1.0, routes: bool = False):
        self.schedule = WeightSchedule(sync_interval=sync_interval, async_depth=async_depth)
        self.report = report
        self.max_new_tokens = max_new_tokens
        self.top_p, self.routes = top_p, routes
        if top_p < 1.0:
            from trl_rollout_corr.support import sampler_from_vllm_params

            self.sampler_contract = lambda trainer: sampler_from_vllm_params({"top_p": top_p})
        self.engine = None
        self.engine_version = None
        self.published: dict[int, dict] = {}
        self.truth: dict[tuple, set] = defaultdict(set)  # (prompt ids, completion ids) -> versions that produced it
        self.calls: list[tuple[int, int]] = []  # (trainer step, engine version) per call

    def _take_weights(self, trainer, step: int) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.engine is None:
            # a fresh copy from the checkpoint: a deepcopy of TRL's prepared policy samples from a broken KV cache
            self.engine = type(model).from_pretrained(model.config._name_or_path, dtype=model.dtype).eval()
            self.engine.load_state_dict(model.state_dict())
        if self.schedule.async_depth:
            self.published.setdefault(step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            target = self.schedule.async_version(step, sorted(self.published))
            if target != self.engine_version:
                self.engine.load_state_dict(self.published[target])
                self.engine_version = target
        elif self.schedule.needs_sync(step, self.engine_version):
            self.engine.load_state_dict(model.state_dict())
            self.engine_version = step

    def __call__(self, prompts, trainer):
        step = int(trainer.state.global_step)
        self._take_weights(trainer, step)
        self.calls.append((step, self.engine_version))
        tok = trainer.processing_class
        prompt_ids = [tok(text=p)["input_ids"] for p in prompts]
        width = max(len(ids) for ids in prompt_ids)
        batch = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids])
        pad = torch.tensor([width - len(ids) for ids in prompt_ids])
        attention = (torch.arange(width)[None, :] >= pad[:, None]).long()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            capture = stack.enter_context(capture_generate_log_probs(self.engine))
            recording = stack.enter_context(record_routes(find_moe_routers(self.engine))) if self.routes else None
            seqs = self.engine.generate(input_ids=batch, attention_mask=attention, do_sample=True,
                                        max_new_tokens=self.max_new_tokens, temperature=1.0, top_k=0,
                                        top_p=self.top_p, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id)
        completions = []
        for row in seqs[:, width:].tolist():
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            completions.append(row[:cut])
        for p, c in zip(prompt_ids, completions):
            self.truth[(tuple(p), tuple(c))].add(self.engine_version)
        out = {"prompt_ids": prompt_ids, "completion_ids": completions,
               "logprobs": capture.completion_log_probs(completions)}
        if recording is not None:
            out["routed_experts"] = recording.generate_rows([len(p) for p in prompt_ids],
                                                            [len(c) for c in completions])
        version = self.engine_version
        if self.report == "version":
            out["policy_version"] = [version] * len(completions)
        elif self.report == "future":
            out["policy_version"] = [step + 1] * len(completions)
        elif self.report == "per_token":
            out["policy_version"] = [[version] * max(len(c), 1) for c in completions]
        elif self.report == "per_token_short":
            out["policy_version"] = [[version] * (len(c) - 1) if len(c) > 1 else [] for c in completions]
        return out

    def true_version(self, prompt_ids, completion_ids):
        """The one version that generated this row, or None when the row is ambiguous (generated twice by
        different versions)."""
        versions = self.truth.get((tuple(prompt_ids), tuple(completion_ids)), set())
        return next(iter(versions)) if len(versions) == 1 else None
