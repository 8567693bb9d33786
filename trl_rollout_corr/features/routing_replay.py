"""Routing replay (``routing_replay="r3"``, Rollout Routing Replay for mixture-of-experts models; ``routing.py``,
``docs/how-to/routing-replay.md``): the rollout's expert choices, recorded while ``transformers.generate`` samples or
returned by a ``rollout_func`` as ``routed_experts``, ride in the batch as ``routed_experts`` and are replayed in the
policy forwards (roles ``old``, ``loss``, ``bypass_loss``, ``batch_norm_window``; never ``ref``) and in
``policy_lag_split``'s weights-at-version forward (role ``version``, on its scratch copy of the policy, by the replayer
that copy carries: ``RouteReplayer.installed_on``).
``rollout_corr/routing_mismatch_fraction`` (overall, ``/layer_<i>``) and ``routing_token_mismatch_fraction`` count the
trainer's own differing choices before substitution, in the forwards that measure (``ForwardCall.measure``).

TRL's own pi_old forward cannot replay (it runs inside TRL's ``_generate_and_score_completions``), so it is replaced
by a placeholder and pi_old is computed afterwards with the routes replayed (role ``old``, by the mode).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from .. import trl_compat
from ..hooks import ROLE_TRAITS, Feature, ForwardCall, GenerationBatch, PlainGenerate, refuse_config
from ..routing import RouteReplayer, check_row_routes, pad_routes, record_routes

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

ROUTING_REPLAY_MODES = ("off", "r3")


class RoutingReplay(Feature):
    """Route capture, collection and replay (module docstring).

    Attributes:
        replayer: the policy's ``routing.RouteReplayer`` (its hooks do nothing outside a replay block).

    Raises:
        ValueError: at construction for a dense model or an unsupported MoE family (``routing.find_moe_routers``);
            before anything loads for TRL's own vLLM path (no routes) or tools (``check_trainer_args``); at the first
            generation for missing routes or routes of the wrong shape (naming the row).
    """

    name = "routing_replay"
    replaces_trl_old_forward = True

    @classmethod
    def wanted(cls, args) -> bool:
        return args.routing_replay == "r3"

    @classmethod
    def check_trainer_args(cls, args, trainer_args: Mapping[str, Any]) -> None:
        """Routes must come from the generation path: refuse TRL's own vLLM path (it returns none: use a
        ``rollout_func`` returning ``routed_experts``, e.g. built with ``routing.routes_from_vllm_outputs``) and
        tools / environments (multi-turn rollouts: the tool turns' routes are not stitched)."""
        if args.use_vllm and trainer_args.get("rollout_func") is None:
            raise ValueError(
                "routing_replay='r3' needs the rollout's routed experts, which TRL's own vLLM path does not return; "
                "generate with a rollout_func that returns 'routed_experts' (trl_rollout_corr.routing."
                "routes_from_vllm_outputs, vLLM on GPU with enable_return_routed_experts=True) or with "
                "transformers.generate (use_vllm=False)."
            )
        if trainer_args.get("tools") or trainer_args.get("environment_factory"):
            raise ValueError(
                "routing_replay='r3' does not support tools or environments yet (the routes of multi-turn rollouts "
                "are not stitched across tool calls); set routing_replay='off'."
            )

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``routing_replay``: one of ``ROUTING_REPLAY_MODES``; ``"r3"`` needs sampled generation and no TRL vLLM IS
        (reads the resolved ``vllm_importance_sampling_correction``)."""
        if args.routing_replay not in ROUTING_REPLAY_MODES:
            refuse_config(f"routing_replay must be one of {ROUTING_REPLAY_MODES}, got {args.routing_replay!r}.")
        kwargs = args.generation_kwargs or {}
        if args.routing_replay == "r3" and (kwargs.get("do_sample") is False or (kwargs.get("num_beams") or 1) > 1):
            refuse_config(
                f"routing_replay='r3' with generation_kwargs={kwargs!r}: routes are recorded from transformers' "
                "sampled generation only (greedy / beam search is generated without the recorder); remove "
                "do_sample=False / num_beams > 1, or set routing_replay='off'."
            )
        if args.routing_replay == "r3" and args.use_vllm and args.vllm_importance_sampling_correction:
            refuse_config(
                "routing_replay='r3' with TRL's own vLLM importance sampling (vllm_importance_sampling_correction="
                "True): TRL's pi_old forward for it cannot replay the routes. Use this package's correction "
                "(e.g. rollout_is='token'; TRL's is then switched off) or set "
                "vllm_importance_sampling_correction=False."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.replayer = RouteReplayer(trainer.model)
        self._recording: Optional[Any] = None

    @contextlib.contextmanager
    def plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> Iterator[None]:
        """Record the routers' choices while ``generate`` samples (only where it yields mu: ``call.capture``)."""
        if call.capture is None:
            yield
            return
        with record_routes(self.replayer.routers) as recording:
            yield
        self._recording = recording

    def after_plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> None:
        """Cut each row's routes out of the ``generate`` recording into ``gen.routes``."""
        recording, self._recording = self._recording, None
        if recording is not None:
            gen.routes = recording.generate_rows([len(p) for p in call.prompt_ids],
                                                 [len(c) for c in call.completion_ids])

    def after_generate(self, trainer, gen: GenerationBatch, result: tuple) -> None:
        """The rows' routes (a ``rollout_func``'s ``routed_experts``, or what ``generate`` recorded), checked against
        the rows (``routing.check_row_routes``)."""
        prompt_ids, completion_ids, extra_fields = result[0], result[1], result[5]
        rows = extra_fields.pop("routed_experts", None) if trainer.rollout_func is not None else gen.routes
        if rows is None:
            raise ValueError(
                "routing_replay='r3' but the generation returned no routes: a rollout_func must return "
                "'routed_experts' (one (prompt + completion tokens, MoE layers, top-k) array per row; see "
                "trl_rollout_corr.routing)."
            )
        gen.routes = check_row_routes(rows, [len(p) for p in prompt_ids], [len(c) for c in completion_ids],
                                      self.replayer.routers)

    def on_batch(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """``batch["routed_experts"]``: (B, P + T, L, k) int16 aligned with ``prompt_ids`` + ``completion_ids`` (-1 at
        padding; a (B, ...) tensor, so TRL's shuffle and split keep it with its rows)."""
        if gen.routes is None:
            raise ValueError("routing_replay='r3' but no routes reached the batch (see RoutingReplay.after_generate).")
        batch["routed_experts"] = pad_routes(gen.routes, batch["prompt_mask"], batch["completion_ids"].size(1))

    @contextlib.contextmanager
    def forward(self, trainer, call: ForwardCall) -> Iterator[None]:
        """Replay the batch's ``routed_experts`` in the policy forwards (role ``version``: with the replayer of
        ``call.model``, a copy of the policy); with ``call.measure`` add the mismatch counts to
        ``rollout_corr/routing_*`` (``RolloutCorrAccumulator.add_fraction_counts``)."""
        if not ROLE_TRAITS[call.role].replayed:  # hooks.ForwardRole
            yield
            return
        routes = call.batch.get("routed_experts")
        if routes is None:
            raise ValueError("routing_replay='r3' but this batch carries no 'routed_experts'.")
        on_counts = (functools.partial(trainer.rollout_corr_metrics.add_fraction_counts, trainer.metrics_mode)
                     if call.measure else None)
        input_ids = trl_compat.prompt_completion_inputs(call.batch).input_ids
        replayer = self.replayer if call.role != "version" else RouteReplayer.installed_on(call.model)
        if replayer is None:
            raise RuntimeError("routing_replay='r3': the copy of the policy for this forward carries no route "
                               "replayer (a copy.deepcopy of the policy carries one); report this.")
        with replayer.replay(routes, input_ids, measure=call.measure, on_counts=on_counts):
            yield
