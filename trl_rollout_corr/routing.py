"""Rollout Routing Replay (R3) for Hugging Face mixture-of-experts models: capture, replay, mismatch metrics.

In a mixture-of-experts (MoE) model every MoE layer sends each token to the ``k`` experts its router scores
highest. A tiny numerical difference between the rollout engine and the trainer flips near-tied choices, so the
trainer computes a different function from the one that sampled, which no re-weighting of the final token
probability can undo. Rollout Routing Replay (R3; Ma et al., 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers") records the engine's choices and makes the trainer's policy forwards use
them. This module does that for the transformers MoE families of ``ROUTER_FAMILIES``; it knows transformers, not
TRL (the trainer wires it in).

Routes (the contract every source follows):
    Per row, an integer tensor ``(n_i, L, k)``: for each token of the row (its prompt tokens, then its completion
    tokens, ``n_i = len(prompt_ids[i]) + len(completion_ids[i])``), each of the model's ``L`` MoE layers (in layer
    order, ``MoERouters.layer_indices``) and each of its ``k`` top-k slots, the expert id the engine selected.
    ``NO_ROUTE`` (-1) fills a token's whole ``(L, k)`` block where no route exists; at a real token that is allowed
    only for the row's last token, which no engine ever runs through the model (its output scores nothing).
    Batched, aligned with TRL's ``torch.cat([prompt_ids, completion_ids], 1)``: ``(B, P + T, L, k)`` int16 with -1
    at padding (``pad_routes``). -1 is the sentinel, never expert 0.

Where routes come from:
    * ``transformers.generate``: ``record_routes`` hooks every router while ``generate`` runs (prefill, then one
      position per decoding step) and ``RouteRecording.generate_rows`` cuts each row's routes out of it.
    * vLLM (GPU only): ``routes_from_vllm`` reads ``CompletionOutput.routed_experts`` of an engine started with
      ``enable_return_routed_experts=True``. vLLM CPU 0.32 refuses that option (it needs Model Runner V2, which needs
      Triton), so this path is tested on constructed output objects.

Replay (``RouteReplayer``):
    A forward hook on each router replaces its top-k selection: every token with a route goes to the recorded
    experts, with gate weights computed from the trainer's own router probabilities at those experts and normalised
    as the family's own top-k rule does (``RouterFamily.gate_weights``), so the router keeps its gradient; no other
    expert receives the token. Tokens without a route keep the trainer's own choice. Before substituting, the hook
    counts the selections where the trainer's own top-k differs from the recorded one (``routing_mismatch_*``).
    What each family couples to in transformers is isolated in ``ROUTER_FAMILIES`` and pinned by
    ``tests/unit/test_routing.py`` (replaying a router's own choice must reproduce its own output bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

NO_ROUTE = -1  # the padding / no-route sentinel; never a valid expert id
ROUTE_DTYPE = torch.int16  # ids up to 32767 experts, -1 sentinel

# Metric names (the trainer logs them as rollout_corr/<name>; per layer: rollout_corr/<name>/layer_<i>).
MISMATCH_KEY = "routing_mismatch_fraction"
TOKEN_MISMATCH_KEY = "routing_token_mismatch_fraction"


# ---------------------------------------------------------------------------------------------- the family table
@dataclass(frozen=True)
class RouterFamily:
    """How one transformers MoE family's router picks and weights its experts (transformers 5.19).

    Every family here has a router module (``router_class`` in ``module``) whose ``forward(hidden_states)`` takes
    ``(N, H)`` hidden states and returns ``(router_logits (N, E), top_k_weights (N, k), top_k_index (N, k))``, with
    ``top_k_weights = topk(softmax(router_logits in float32))`` optionally renormalised to sum 1 and optionally cast
    back to the logits' dtype; the MoE block then calls its (fused) experts with exactly those indices and weights.

    Attributes:
        model_type: the transformers ``config.model_type``.
        module: the modeling module that defines the router.
        router_class: the router's class name.
        normalise: ``"always"`` (renormalise the k weights to sum 1) or the name of the router attribute that says
            whether to (``"norm_topk_prob"``).
        cast_to_logits_dtype: whether the weights are cast back to the router logits' dtype (else float32).
    """

    model_type: str
    module: str
    router_class: str
    normalise: str = "norm_topk_prob"
    cast_to_logits_dtype: bool = True

    def router_type(self) -> Optional[type]:
        """The router class, or None when this transformers has no such module/class."""
        try:
            return getattr(importlib.import_module(self.module), self.router_class, None)
        except ImportError:
            return None

    def normalises(self, router: torch.nn.Module) -> bool:
        return True if self.normalise == "always" else bool(getattr(router, self.normalise))

    def gate_weights(self, router: torch.nn.Module, router_logits: torch.Tensor, expert_ids: torch.Tensor):
        """The gate weights this family's top-k rule gives ``expert_ids`` (the router's own probabilities there).

        Args:
            router: the router module (for its normalisation flag).
            router_logits: (N, E) the router's logits (with grad: the weights stay differentiable).
            expert_ids: (N, k) int64 expert ids, each in [0, E).

        Returns:
            (N, k) weights, in the dtype the family returns; bit-identical to the router's own output when
            ``expert_ids`` is its own top-k (pinned in ``tests/unit/test_routing.py``).
        """
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights = probs.gather(-1, expert_ids)
        if self.normalises(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype) if self.cast_to_logits_dtype else weights


def _family(model_type: str, router_class: str, **kw: Any) -> RouterFamily:
    return RouterFamily(model_type, f"transformers.models.{model_type}.modeling_{model_type}", router_class, **kw)


# The one table of the transformers coupling (transformers 5.19; see tests/unit/test_routing.py's pins). Adding a
# family whose router follows the RouterFamily contract is one line; a family with another rule (group-limited top-k,
# sigmoid scores with a bias, sparsemixer, ...) needs its own gate_weights first.
ROUTER_FAMILIES: dict[str, RouterFamily] = {
    f.model_type: f
    for f in (
        _family("qwen2_moe", "Qwen2MoeTopKRouter"),
        _family("qwen3_moe", "Qwen3MoeTopKRouter"),
        _family("olmoe", "OlmoeTopKRouter"),
        # Mixtral always renormalises and keeps float32 weights
        _family("mixtral", "MixtralTopKRouter", normalise="always", cast_to_logits_dtype=False),
    )
}

# config attributes that mark a model as mixture-of-experts (for the "unsupported family" error)
_MOE_CONFIG_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoERouters:
    """The MoE routers of a model, in layer order (``find_moe_routers``).

    Attributes:
        family: the ``RouterFamily``.
        routers: the router modules, one per MoE layer, in layer order.
        layer_indices: the decoder-layer index of each router (dense layers of a mixed model are skipped).
        base: the module that owns the decoder layers (it receives ``input_ids`` / ``inputs_embeds``).
        num_experts: E, experts per layer.
        top_k: k, experts per token.
    """

    family: RouterFamily
    routers: tuple
    layer_indices: tuple
    base: torch.nn.Module
    num_experts: int
    top_k: int

    @property
    def num_layers(self) -> int:
        return len(self.routers)


def find_moe_routers(model: torch.nn.Module) -> MoERouters:
    """The routers of ``model`` (any wrapper: PEFT, DDP) for one family of ``ROUTER_FAMILIES``.

    Raises:
        ValueError: the model has no MoE router (a dense model), its MoE family is not in ``ROUTER_FAMILIES``
            (the message names the supported families), or it mixes families / expert counts / k across layers.
    """
    types = {f.model_type: f.router_type() for f in ROUTER_FAMILIES.values()}
    found: dict[str, list] = {}
    for name, module in model.named_modules():
        for model_type, cls in types.items():
            if cls is not None and type(module) is cls:
                found.setdefault(model_type, []).append((name, module))
    if not found:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", type(model).__name__)
        if any(getattr(config, attr, None) for attr in _MOE_CONFIG_ATTRS):
            raise ValueError(
                f"routing replay supports the transformers MoE families {sorted(ROUTER_FAMILIES)}; this model "
                f"({model_type}) has experts but no router of those families (add its RouterFamily to "
                "trl_rollout_corr.routing.ROUTER_FAMILIES, or set routing_replay='off')."
            )
        raise ValueError(
            f"routing replay needs a mixture-of-experts model; {model_type} has no MoE layer (set "
            "routing_replay='off' for a dense model)."
        )
    if len(found) > 1:
        raise ValueError(f"the model mixes MoE router families {sorted(found)}; routing replay needs one.")
    (model_type, named), = found.items()
    layered = []
    for name, module in named:
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise ValueError(f"cannot tell the decoder layer of router {name!r} (expected '...layers.<i>....').")
        layered.append((int(match.group(1)), name, module))
    layered.sort(key=lambda item: item[0])
    experts = {int(m.num_experts) for _, _, m in layered}
    top_k = {int(m.top_k) for _, _, m in layered}
    if len(experts) != 1 or len(top_k) != 1:
        raise ValueError(f"routers differ in num_experts {sorted(experts)} or top_k {sorted(top_k)} across layers.")
    num_experts = experts.pop()
    if num_experts > torch.iinfo(ROUTE_DTYPE).max:
        raise ValueError(f"{num_experts} experts do not fit the {ROUTE_DTYPE} routes.")
    first = layered[0][1]
    base_name = first[: _LAYER_INDEX.search(first).start()]
    return MoERouters(
        family=ROUTER_FAMILIES[model_type],
        routers=tuple(m for _, _, m in layered),
        layer_indices=tuple(i for i, _, _ in layered),
        base=model.get_submodule(base_name) if base_name else model,
        num_experts=num_experts,
        top_k=top_k.pop(),
    )


# ---------------------------------------------------------------------------------------------- recording
@dataclass
class RouteRecording:
    """Every router call's top-k selection while ``record_routes`` was active.

    Attributes:
        calls: per MoE layer (layer order), the ``(N, k)`` int16 selections of each router call, in call order.
    """

    calls: list = field(default_factory=list)

    def _stacked_calls(self) -> list:
        counts = {len(c) for c in self.calls}
        if len(counts) != 1:
            raise RuntimeError(f"MoE layers recorded different numbers of router calls: {sorted(counts)}.")
        return [torch.stack([layer[c] for layer in self.calls], dim=1) for c in range(counts.pop())]  # (N, L, k)

    def forward_routes(self, batch_size: int) -> torch.Tensor:
        """The routes of exactly one forward over a ``(B, S)`` batch: ``(B, S, L, k)`` int16.

        Raises:
            RuntimeError: if not exactly one forward was recorded, or its size is not a multiple of B.
        """
        calls = self._stacked_calls()
        if len(calls) != 1 or calls[0].size(0) % batch_size:
            raise RuntimeError(f"expected one forward over {batch_size} rows, recorded {len(calls)} router calls.")
        return calls[0].view(batch_size, -1, *calls[0].shape[1:])

    def generate_rows(self, prompt_lengths: Sequence[int], completion_lengths: Sequence[int]) -> list:
        """Each row's routes (contract in the module docstring) from one ``generate`` call with KV cache.

        ``generate`` runs the left-padded ``(B, P)`` prompts once (prefill), then one position per decoding step,
        feeding back the token it sampled: completion token ``t`` goes through the model at decoding step ``t + 1``
        and the last sampled token never does (its routes are ``NO_ROUTE``).

        Args:
            prompt_lengths: B prompt lengths in tokens (unpadded).
            completion_lengths: B completion lengths in tokens (as the caller keeps them, e.g. cut after EOS).

        Returns:
            B int16 tensors ``(prompt_lengths[i] + completion_lengths[i], L, k)`` on the CPU.

        Raises:
            RuntimeError: the recording is not one prefill plus single-position steps over B rows, or a row has
                more completion tokens than were generated.
        """
        batch = len(prompt_lengths)
        calls = self._stacked_calls()
        if not calls or calls[0].size(0) % batch or any(c.size(0) != batch for c in calls[1:]):
            raise RuntimeError(
                f"expected one generate() call over {batch} rows (a prefill, then one position per step); recorded "
                f"router calls of sizes {[c.size(0) for c in calls][:4]}... (several generate calls, chunked "
                "prefill or assisted decoding are not supported)."
            )
        prefill = calls[0].view(batch, -1, *calls[0].shape[1:]).cpu()  # (B, P, L, k)
        width = prefill.size(1)
        decode = torch.stack(calls[1:], dim=1).cpu() if len(calls) > 1 else prefill[:, :0]  # (B, steps, L, k)
        rows = []
        for i, (p, t) in enumerate(zip(prompt_lengths, completion_lengths)):
            p, t = int(p), int(t)
            if p > width or t > decode.size(1) + 1:
                raise RuntimeError(
                    f"Row {i}: {p} prompt and {t} completion tokens, but generate ran {width} prompt positions and "
                    f"{decode.size(1)} decoding steps; the recorded routes cannot cover the row."
                )
            missing = torch.full((t - min(t, decode.size(1)), *prefill.shape[2:]), NO_ROUTE, dtype=ROUTE_DTYPE)
            rows.append(torch.cat([prefill[i, width - p:], decode[i, :t], missing]))
        return rows


@contextlib.contextmanager
def record_routes(routers: MoERouters) -> Iterator[RouteRecording]:
    """Within the block, every call of every router appends its top-k selection to the yielded recording.

    The hooks read the router's returned ``top_k_index`` (after any replay substitution by a ``RouteReplayer``
    registered earlier), detached, as int16; they are removed on exit, also on error.
    """
    recording = RouteRecording(calls=[[] for _ in routers.routers])

    def make_hook(layer: list) -> Callable:
        def hook(module, args, output):
            layer.append(output[2].detach().to(ROUTE_DTYPE))

        return hook

    handles = [r.register_forward_hook(make_hook(layer)) for r, layer in zip(routers.routers, recording.calls)]
    try:
        yield recording
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- checking, padding
def check_row_routes(
    routes: Sequence,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    routers: MoERouters,
) -> list:
    """Validate per-row routes against the rows' token counts and the model, and return them as int16 tensors.

    Args:
        routes: B per-row routes (tensors, NumPy arrays or nested lists), each ``(n_i, L, k)`` (module docstring).
        prompt_lengths, completion_lengths: B token counts; ``n_i`` must be their sum.
        routers: the model's ``MoERouters`` (L, k, E).

    Returns:
        B int16 CPU tensors ``(n_i, L, k)``.

    Raises:
        ValueError: naming the first bad row: a missing row, a wrong number of tokens, MoE layers or top-k slots,
            an expert id outside [-1, E), a token with some but not all slots -1, a -1 token other than the row's
            last, or an expert selected twice for one token.
    """
    if len(routes) != len(prompt_lengths):
        raise ValueError(f"Got routes for {len(routes)} rows but the batch has {len(prompt_lengths)}.")
    shape = (routers.num_layers, routers.top_k)
    out = []
    for row, (r, p, t) in enumerate(zip(routes, prompt_lengths, completion_lengths)):
        if r is None:
            raise ValueError(f"Row {row}: no routes (routing_replay='r3' needs every row's routed experts).")
        r = torch.as_tensor(r if not torch.is_tensor(r) else r.detach().cpu())
        n = int(p) + int(t)
        if r.dim() != 3 or tuple(r.shape) != (n, *shape):
            raise ValueError(
                f"Row {row}: routes of shape {tuple(r.shape)}, expected ({n}, {shape[0]}, {shape[1]}) = "
                f"({p} prompt + {t} completion tokens, {shape[0]} MoE layers, top-{shape[1]})."
            )
        if r.is_floating_point() or r.dtype == torch.bool:
            raise ValueError(f"Row {row}: routes must be integer expert ids, got {r.dtype}.")
        r = r.long()
        if bool(((r < NO_ROUTE) | (r >= routers.num_experts)).any()):
            raise ValueError(f"Row {row}: expert ids must lie in [0, {routers.num_experts}) (or -1 for no route).")
        absent = (r == NO_ROUTE).flatten(1)
        partial = (absent.any(1) & ~absent.all(1)).nonzero().flatten()
        if partial.numel():
            raise ValueError(f"Row {row}: token {int(partial[0])} has -1 in some layers/slots but not all.")
        unrouted = absent.all(1).nonzero().flatten()
        if unrouted.numel() and (unrouted.numel() > 1 or int(unrouted[0]) != n - 1):
            raise ValueError(
                f"Row {row}: token {int(unrouted[0])} of {n} has no route; only the row's last token (never run "
                "through the model by the engine) may lack one."
            )
        ordered = r.sort(dim=-1).values
        if shape[1] > 1 and bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
            raise ValueError(f"Row {row}: a token selects the same expert twice in one layer.")
        out.append(r.to(ROUTE_DTYPE))
    return out


def pad_routes(rows: Sequence[torch.Tensor], prompt_mask: torch.Tensor, completion_width: int) -> torch.Tensor:
    """Lay per-row routes out like TRL's batch: left-padded prompts, then right-padded completions.

    Args:
        rows: B int16 ``(n_i, L, k)`` routes (``check_row_routes``), prompt tokens first.
        prompt_mask: (B, P) 0/1, TRL's left-padded prompt mask; row i has ``p_i = prompt_mask[i].sum()`` tokens.
        completion_width: T, the padded completion width.

    Returns:
        (B, P + T, L, k) int16 on ``prompt_mask``'s device, aligned with ``torch.cat([prompt_ids, completion_ids],
        1)``; ``NO_ROUTE`` at every padding position.

    Raises:
        ValueError: a row has fewer routes than prompt tokens, or more completion routes than T (naming the row).
    """
    batch, width = prompt_mask.shape
    if len(rows) != batch:
        raise ValueError(f"Got routes for {len(rows)} rows but the batch has {batch}.")
    tail = rows[0].shape[1:] if rows else ()
    out = torch.full((batch, width + completion_width, *tail), NO_ROUTE, dtype=ROUTE_DTYPE)
    for i, (r, p) in enumerate(zip(rows, prompt_mask.sum(dim=1).tolist())):
        t = r.size(0) - int(p)
        if t < 0 or t > completion_width:
            raise ValueError(
                f"Row {i}: {r.size(0)} routed tokens for {int(p)} prompt tokens and a completion width of "
                f"{completion_width}; the routes do not align with the row."
            )
        out[i, width - int(p): width + t] = r
    return out.to(prompt_mask.device)


# ---------------------------------------------------------------------------------------------- vLLM (GPU only)
def routes_from_vllm(completion: Any, prompt_length: int, routers: MoERouters, row: int = 0) -> torch.Tensor:
    """One row's routes from a vLLM ``CompletionOutput`` (vLLM >= 0.32 on GPU with ``enable_return_routed_experts``).

    vLLM 0.32 returns ``CompletionOutput.routed_experts``, a NumPy array ``(P + T - 1, num_hidden_layers, k)``
    (uint8 for <= 256 experts, else uint16): every token of the sequence except the last sampled one (never run
    through the model), every decoder layer (dense layers of a mixed model hold no route), with
    ``SamplingParams.routed_experts_prompt_start = 0`` (the default; a later start drops prompt routes and is
    refused here). GPU only: vLLM CPU 0.32 refuses the option (it needs Model Runner V2, which needs Triton).

    Args:
        completion: the ``CompletionOutput`` (anything with ``token_ids`` and ``routed_experts``).
        prompt_length: P, the prompt's token count.
        routers: the trainer model's ``MoERouters`` (its MoE layer indices and k).
        row: the row index, for error messages.

    Returns:
        (P + T, L, k) int16, the last token ``NO_ROUTE``; ready for ``check_row_routes``.

    Raises:
        ValueError: no routed experts (the engine was not started with ``enable_return_routed_experts=True``), or
            a shape that does not match the row's tokens, the model's layers or k (naming the row).
    """
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        raise ValueError(
            f"Row {row}: vLLM returned no routed experts; start the engine with enable_return_routed_experts=True "
            "(GPU, vLLM >= 0.32; vLLM CPU refuses it)."
        )
    routed = torch.as_tensor(routed.astype("int64") if hasattr(routed, "astype") else routed).long()
    n = int(prompt_length) + len(completion.token_ids)
    if routed.dim() != 3 or routed.size(0) != n - 1 or routed.size(2) != routers.top_k:
        raise ValueError(
            f"Row {row}: vLLM routed experts of shape {tuple(routed.shape)}, expected ({n - 1}, layers, "
            f"{routers.top_k}) for {prompt_length} prompt + {len(completion.token_ids)} completion tokens "
            "(routed_experts_prompt_start must be 0)."
        )
    if max(routers.layer_indices) >= routed.size(1):
        raise ValueError(
            f"Row {row}: vLLM returned routes for {routed.size(1)} layers; the model's MoE layers are "
            f"{list(routers.layer_indices)}."
        )
    moe = routed[:, list(routers.layer_indices)]
    last = torch.full((1, *moe.shape[1:]), NO_ROUTE, dtype=torch.long)
    return torch.cat([moe, last]).to(ROUTE_DTYPE)


def routes_from_vllm_outputs(request_outputs: Sequence[Any], routers: MoERouters) -> list:
    """Per-row routes of a ``vllm.LLM.generate`` result: one row per completion, requests in order, ``n`` completions
    of a request consecutive (as TRL's rollout_func rows are). GPU only; see ``routes_from_vllm``."""
    rows = []
    for out in request_outputs:
        for completion in out.outputs:
            rows.append(routes_from_vllm(completion, len(out.prompt_token_ids), routers, row=len(rows)))
    return rows


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class _Binding:
    routes: torch.Tensor  # (B, S, L, k) int16
    input_ids: torch.Tensor  # (B, S)
    measure: bool
    on_counts: Optional[Callable[[dict], None]]
    cursor: int = 0


@dataclass
class _Chunk:
    routes: torch.Tensor  # (b, S, L, k) int64 on the model's device
    measure: bool
    on_counts: Optional[Callable[[dict], None]]
    seen: set = field(default_factory=set)
    token_mismatch: Optional[torch.Tensor] = None


class RouteReplayer:
    """Replays recorded routes in a model's forwards (R3), within ``replay`` blocks; see the module docstring.

    The hooks are installed once (``find_moe_routers(model)``) and stay until ``remove()``; outside a ``replay``
    block they change nothing. A pre-hook on the decoder stack (``MoERouters.base``) takes, at every top-level
    forward, the next rows of the bound routes (TRL's log-prob forward may run the batch in row chunks); the
    routers' hooks then substitute those rows' routes, layer by layer. The chunk stays current until the next
    top-level forward, so gradient checkpointing's recompute in the backward (which re-runs the decoder layers, not
    the stack's pre-hook) replays the same routes; ``replay`` refuses several chunks under gradient checkpointing
    with grad enabled (the recompute of an earlier chunk could not be told apart). A ``copy.deepcopy`` of the model
    carries its own copy of the replayer (``installed_on(copy)``), which replays only in its own ``replay`` blocks.

    Args:
        model: a model (or wrapper) whose routers belong to one ``ROUTER_FAMILIES`` family.

    Raises:
        ValueError: from ``find_moe_routers`` (dense model, unsupported family).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_moe_routers(model)
        self._binding: Optional[_Binding] = None
        self._current: Optional[_Chunk] = None
        self._handles = [self.routers.base.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        for position, router in enumerate(self.routers.routers):
            self._handles.append(router.register_forward_hook(self._router_hook(position)))

    @staticmethod
    def installed_on(model: torch.nn.Module) -> Optional["RouteReplayer"]:
        """The replayer whose hooks are on ``model``'s MoE decoder stack, or None: the one built on it, or the copy
        that a ``copy.deepcopy`` of a model with a replayer carries (bound to the copy's modules, with its own
        state).

        Raises:
            ValueError: from ``find_moe_routers`` (dense model, unsupported family).
        """
        base = find_moe_routers(model).base
        for hook in base._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, RouteReplayer) and owner.routers.base is base:
                return owner
        return None

    def remove(self) -> None:
        """Remove the hooks (the model then routes as it always did)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._binding, self._current = [], None, None

    @contextlib.contextmanager
    def replay(
        self,
        routes: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        measure: bool = True,
        on_counts: Optional[Callable[[dict], None]] = None,
    ) -> Iterator[None]:
        """Within the block, the model's forwards over ``input_ids`` (in row order, whole or in row chunks) route
        every token with a route to its recorded experts.

        Args:
            routes: (B, S, L, k) integer routes aligned with ``input_ids`` (``pad_routes``), -1 where none.
            input_ids: (B, S), the rows the forwards will see (each chunk is checked against them).
            measure: count, before substituting, the selections where the model's own top-k differs from the
                recorded one (once per layer and chunk; the recompute of gradient checkpointing is not counted).
            on_counts: receives ``{name: (mismatched, total)}`` 0-d int64 tensors per layer and chunk:
                ``routing_mismatch_fraction`` and ``routing_mismatch_fraction/layer_<i>`` (selections),
                ``routing_token_mismatch_fraction`` (tokens with a different selection in at least one layer).

        Raises:
            ValueError: at entry, routes of the wrong shape for ``input_ids`` or the model (L, k), or nested
                ``replay`` blocks; in a forward, a chunk that is not the next rows of ``input_ids`` (or is longer).
            RuntimeError: at exit, if the forwards did not consume every row (the model's forward bypassed the hooked
                decoder stack: nothing would have been replayed).
        """
        expected = (*input_ids.shape, self.routers.num_layers, self.routers.top_k)
        if tuple(routes.shape) != expected:
            raise ValueError(
                f"routes of shape {tuple(routes.shape)} for input_ids {tuple(input_ids.shape)}; expected {expected} "
                "(rows, positions, MoE layers, top-k)."
            )
        if self._binding is not None:
            raise ValueError("replay blocks do not nest.")
        self._binding = binding = _Binding(routes, input_ids, measure, on_counts)
        ok = False
        try:
            yield
            ok = True
        finally:
            self._binding = None
        if ok and binding.cursor != routes.size(0):
            raise RuntimeError(
                f"the replayed forwards consumed {binding.cursor} of {routes.size(0)} rows: the model's forward did "
                "not go through the hooked MoE decoder stack, so routes were not (all) replayed."
            )

    # -------------------------------------------------------------- hooks
    def _on_forward(self, module, args, kwargs):
        binding = self._binding
        if binding is None:
            self._current = None
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        rows, width = (ids if ids is not None else embeds).shape[:2]
        start = binding.cursor
        if start + rows > binding.routes.size(0) or width != binding.routes.size(1):
            raise ValueError(
                f"a forward over ({rows}, {width}) tokens after {start} replayed rows does not match the bound "
                f"routes {tuple(binding.routes.shape[:2])}."
            )
        if ids is not None and not torch.equal(ids, binding.input_ids[start: start + rows].to(ids.device)):
            raise ValueError(f"rows {start}..{start + rows - 1} of this forward are not the tokens of their routes.")
        if start and torch.is_grad_enabled() and self._checkpointing():
            raise NotImplementedError(
                "routing replay under gradient checkpointing needs one forward per replay block with grad enabled."
            )
        binding.cursor += rows
        device = (ids if ids is not None else embeds).device
        chunk_routes = binding.routes[start: start + rows].to(device=device, dtype=torch.long)
        self._current = _Chunk(chunk_routes, binding.measure, binding.on_counts)
        return None

    def _checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) and m.training for m in self.routers.base.modules())

    def _router_hook(self, position: int) -> Callable:
        # a partial of a bound method, not a closure over ``self``: a deep copy of the model (``copy.deepcopy``, e.g.
        # policy_lag_split's scratch copy) then carries its own copy of this replayer (``installed_on``), idle outside
        # its own replay blocks, instead of hooks that substitute this replayer's current chunk
        return functools.partial(self._route, position)

    def _route(self, position: int, module, args, output):
        """The router hook of MoE layer ``position``: its own top-k replaced by the current chunk's routes."""
        chunk = self._current
        if chunk is None:
            return None
        family, layer = self.routers.family, self.routers.layer_indices[position]
        logits, _, own = output
        recorded = chunk.routes[:, :, position].reshape(-1, chunk.routes.size(-1))
        if recorded.size(0) != own.size(0):
            raise RuntimeError(
                f"layer {layer}: the router saw {own.size(0)} tokens, the bound routes hold {recorded.size(0)}."
            )
        routed = recorded[:, 0] != NO_ROUTE
        if chunk.measure and position not in chunk.seen:
            self._count(chunk, layer, recorded, own, routed, position == self.routers.num_layers - 1)
        chunk.seen.add(position)
        expert_ids = torch.where(routed.unsqueeze(-1), recorded, own)
        return logits, family.gate_weights(module, logits, expert_ids), expert_ids

    @staticmethod
    def _count(chunk: _Chunk, layer: int, recorded, own, routed, last: bool) -> None:
        with torch.no_grad():
            kept = (recorded.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)  # (N, k): recorded expert also chosen
            differs = (~kept) & routed.unsqueeze(-1)
            total = routed.sum() * recorded.size(-1)
            counts = {MISMATCH_KEY: (differs.sum(), total), f"{MISMATCH_KEY}/layer_{layer}": (differs.sum(), total)}
            any_differs = differs.any(-1)
            chunk.token_mismatch = any_differs if chunk.token_mismatch is None else chunk.token_mismatch | any_differs
            if last:
                counts[TOKEN_MISMATCH_KEY] = (chunk.token_mismatch.sum(), routed.sum())
        if chunk.on_counts is not None:
            chunk.on_counts(counts)
