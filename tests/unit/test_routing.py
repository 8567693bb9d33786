"""routing: the transformers MoE coupling (pinned), route capture on generate, the route contract and its errors,
replay (recorded experts, the family's own gate weights, router gradients, chunks, gradient checkpointing), the
mismatch counts, and the vLLM reader on constructed output objects. Tiny random MoE models (head_dim 32), CPU."""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tiny_model import MOE_ARCHS, make_tiny_model
from trl_rollout_corr import routing
from trl_rollout_corr.routing import (
    NO_ROUTE,
    ROUTER_FAMILIES,
    RouteReplayer,
    check_row_routes,
    find_moe_routers,
    pad_routes,
    record_routes,
    routes_from_vllm,
    routes_from_vllm_outputs,
)

# left-padded prompts of different lengths (pad 0), as TRL's generate path lays them out
PROMPTS = [[2, 10, 11, 12], [2, 13, 14], [2, 15, 16, 17, 18], [2, 19]]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request):
    model, _ = make_tiny_model(request.param, seed=0)
    return model.eval()


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return ids, (ids != 0).long()


def _batch(seed=0, rows=4, prompt=5, completion=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (rows, prompt + completion), generator=g)
    return ids, torch.ones_like(ids)


def _completion_log_probs(model, ids, mask, completion):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -completion - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -completion:, None]).squeeze(-1)


def _own_routes(model, ids, mask):
    with torch.no_grad(), record_routes(find_moe_routers(model)) as rec:
        model(input_ids=ids, attention_mask=mask)
    return rec.forward_routes(ids.size(0))


def _other_routes(own: torch.Tensor, num_experts: int, seed: int = 0) -> torch.Tensor:
    """Valid routes that differ from ``own`` at most positions (a random distinct k-subset per token and layer)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*own.shape[:-1], num_experts, generator=g)
    return scores.topk(own.size(-1), dim=-1).indices.to(own.dtype)


# ---------------------------------------------------------------------------------------------- transformers pins
def test_router_family_table_pins_transformers(moe):
    """Each family's coupling, as the table describes it: router class, (logits, weights, index) output, and the
    top-k rule: re-weighting the router's own choice with RouterFamily.gate_weights gives its own weights bit for
    bit, in float32 and in bfloat16 (fails loudly when transformers changes a router)."""
    import transformers

    assert transformers.__version__.startswith("5.19."), "routing.ROUTER_FAMILIES is pinned to transformers 5.19"
    routers = find_moe_routers(moe)
    family = routers.family
    assert family is ROUTER_FAMILIES[moe.config.model_type] and type(routers.routers[0]) is family.router_type()
    src = inspect.getsource(family.router_type().forward)
    assert "F.linear(hidden_states, self.weight)" in src and "torch.topk(router_probs, self.top_k, dim=-1)" in src
    assert ("/= router_top_value.sum(dim=-1, keepdim=True)" in src) and (
        ("if self.norm_topk_prob:" in src) == (family.normalise == "norm_topk_prob"))
    assert ("router_top_value.to(router_logits.dtype)" in src) == family.cast_to_logits_dtype
    assert "return router_logits, router_scores, router_indices" in src
    # the MoE block hands the router's (weights, index) to its experts unchanged
    block = next(m for m in moe.modules() if getattr(m, "gate", None) is routers.routers[0])
    block_src = inspect.getsource(type(block).forward)
    assert "self.gate(hidden_states" in block_src and "self.experts(hidden_states" in block_src
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        router = copy.deepcopy(routers.routers[0]).to(dtype)
        hidden = torch.randn(37, moe.config.hidden_size, generator=g).to(dtype)
        logits, weights, index = router(hidden)
        assert logits.shape == (37, routers.num_experts) and index.shape == weights.shape == (37, routers.top_k)
        replayed = family.gate_weights(router, logits, index)
        assert replayed.dtype == weights.dtype and torch.equal(replayed, weights), (family.model_type, dtype)


def test_gate_weights_by_hand():
    """softmax over all experts, taken at the recorded ones, renormalised when the family says so."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    ids = torch.tensor([[3, 1]])
    norm = SimpleNamespace(norm_topk_prob=True)
    plain = SimpleNamespace(norm_topk_prob=False)
    qwen, olmoe, mixtral = (ROUTER_FAMILIES[k] for k in ("qwen3_moe", "olmoe", "mixtral"))
    expected = torch.tensor([[p[3] / (p[3] + p[1]), p[1] / (p[3] + p[1])]])
    assert torch.allclose(qwen.gate_weights(norm, logits, ids), expected, atol=1e-7)
    assert torch.allclose(olmoe.gate_weights(plain, logits, ids), torch.tensor([[p[3], p[1]]]), atol=1e-7)
    # Mixtral: always renormalised, float32 even from bf16 logits; Qwen: cast back to the logits' dtype
    bf16 = logits.to(torch.bfloat16)
    assert mixtral.gate_weights(plain, bf16, ids).dtype == torch.float32
    assert torch.allclose(mixtral.gate_weights(plain, bf16, ids), expected, atol=1e-6)
    assert qwen.gate_weights(norm, bf16, ids).dtype == torch.bfloat16


def test_find_moe_routers_layers_and_errors():
    qwen2_moe, _ = make_tiny_model("qwen2_moe", seed=0)  # layer 0 dense, layer 1 MoE
    found = find_moe_routers(qwen2_moe)
    assert (found.layer_indices, found.num_experts, found.top_k) == ((1,), 8, 2)
    assert found.base is qwen2_moe.model and found.routers == (qwen2_moe.model.layers[1].mlp.gate,)
    llama, _ = make_tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; llama has no MoE layer"):
        find_moe_routers(llama)
    other = torch.nn.Linear(2, 2)
    other.config = SimpleNamespace(model_type="deepseek_v3", n_routed_experts=8)
    with pytest.raises(ValueError, match=r"supports the transformers MoE families \['mixtral', 'olmoe'"):
        find_moe_routers(other)


# ---------------------------------------------------------------------------------------------- capture
def test_generate_capture_follows_every_row(moe):
    """Routes recorded while generate samples (float32): each row's prompt tokens (left padding cut), then its
    completion tokens; the last sampled token has no route; all equal a full forward's own routes there."""
    ids, mask = _left_padded(PROMPTS)
    routers = find_moe_routers(moe)
    torch.manual_seed(0)
    with torch.no_grad(), record_routes(routers) as rec:
        out = moe.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=6, min_new_tokens=6,
                           pad_token_id=0)
    completion_lengths = [6, 3, 6, 1]  # rows as a caller may cut them (after an EOS, say)
    rows = rec.generate_rows([len(p) for p in PROMPTS], completion_lengths)
    for i, (p, t) in enumerate(zip(PROMPTS, completion_lengths)):
        assert rows[i].shape == (len(p) + t, routers.num_layers, routers.top_k) and rows[i].dtype == torch.int16
        assert bool((rows[i][-1] == NO_ROUTE).all()) == (t == 6)  # only a token generate never fed back
        assert bool((rows[i][:-1] >= 0).all())
        tokens = torch.cat([torch.tensor(p), out[i, ids.size(1): ids.size(1) + t]])[None]
        own = _own_routes(moe, tokens, torch.ones_like(tokens))[0]
        routed = rows[i][:, 0, 0] >= 0
        assert torch.equal(rows[i][routed].sort(-1).values, own[routed].sort(-1).values)
    with pytest.raises(RuntimeError, match="Row 0: 4 prompt and 8 completion tokens"):
        rec.generate_rows([len(p) for p in PROMPTS], [8, 1, 1, 1])
    with pytest.raises(RuntimeError, match="one generate"):
        rec.generate_rows([4, 4, 4], [1, 1, 1])  # 4 rows were generated, not 3


def test_check_row_routes_names_the_row():
    routers = SimpleNamespace(num_layers=2, top_k=2, num_experts=4)
    good = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[-1, -1], [-1, -1]]])  # (3 tokens, 2 layers, k=2)
    out = check_row_routes([good, good.numpy(), good[:2].tolist()], [1, 2, 1], [2, 1, 1], routers)
    assert all(torch.equal(o, good[: o.size(0)].to(torch.int16)) for o in out) and out[0].dtype == torch.int16
    bad = {
        "Row 1: routes of shape \\(3, 2, 2\\), expected \\(4, 2, 2\\)": ([good, good], [1, 2], [2, 2]),
        "Row 0: routes of shape \\(3, 1, 2\\)": ([good[:, :1]], [1], [2]),
        "Row 0: routes of shape \\(3, 2, 1\\)": ([good[..., :1]], [1], [2]),
        "Row 0: expert ids must lie in \\[0, 4\\)": ([good.masked_fill(good == 3, 4)], [1], [2]),
        "Row 0: token 0 has -1 in some": ([torch.cat([torch.tensor([[[0, -1], [2, 3]]]), good[1:]])], [1], [2]),
        "Row 0: token 0 of 3 has no route": ([good.flip(0)], [1], [2]),
        "Row 0: a token selects the same expert twice": ([good.masked_fill(good == 1, 0)], [1], [2]),
        "Row 1: no routes": ([good, None], [1, 1], [2, 2]),
        "routes must be integer": ([good.float()], [1], [2]),
        "Got routes for 1 rows but the batch has 2": ([good], [1, 1], [2, 2]),
    }
    for message, (rows, p, t) in bad.items():
        with pytest.raises(ValueError, match=message):
            check_row_routes(rows, p, t, routers)


def test_pad_routes_lays_rows_out_like_trl():
    r0 = torch.arange(3 * 1 * 2, dtype=torch.int16).view(3, 1, 2)  # 1 prompt + 2 completion tokens
    r1 = torch.arange(100, 104, dtype=torch.int16).view(2, 1, 2)  # 2 prompt + 0 completion tokens
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    out = pad_routes([r0, r1], prompt_mask, completion_width=3)
    expected = torch.full((2, 5, 1, 2), -1, dtype=torch.int16)
    expected[0, 1:4] = r0
    expected[1, 0:2] = r1
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="Row 0: 3 routed tokens for 1 prompt tokens and a completion width of 1"):
        pad_routes([r0, r1], prompt_mask, completion_width=1)


# ---------------------------------------------------------------------------------------------- replay
def test_replay_of_own_routes_is_the_normal_forward(moe):
    """Routes recorded from the trainer itself in float32, replayed: log-probs and router gradients identical."""
    ids, mask = _batch()
    own = _own_routes(moe, ids, mask)
    routers = find_moe_routers(moe)
    moe.zero_grad()
    plain = _completion_log_probs(moe, ids, mask, 7)
    plain.sum().backward()
    plain_grads = [r.weight.grad.clone() for r in routers.routers]
    replayer = RouteReplayer(moe)
    try:
        moe.zero_grad()
        with replayer.replay(own, ids):
            replayed = _completion_log_probs(moe, ids, mask, 7)
        replayed.sum().backward()
        assert torch.equal(replayed, plain)
        for r, g in zip(routers.routers, plain_grads):
            assert torch.equal(r.weight.grad, g)
    finally:
        replayer.remove()
        moe.zero_grad()


def test_replay_routes_to_recorded_experts_with_router_gradients(moe):
    """Other routes replayed: the experts get exactly the recorded ids (own choice where -1), with the family's
    gate weights of the router's own probabilities there; the router weights get a gradient; nothing outside."""
    ids, mask = _batch(seed=1)
    routers = find_moe_routers(moe)
    own = _own_routes(moe, ids, mask)
    routes = _other_routes(own, routers.num_experts)
    routes[:, -1] = NO_ROUTE  # the last position of every row: keep the model's own choice
    seen = []

    def experts_pre_hook(module, args):
        seen.append((args[1].clone(), args[2].detach().clone()))

    handles = [r_parent.register_forward_pre_hook(experts_pre_hook)
               for r_parent in (m.experts for m in moe.modules() if hasattr(m, "experts") and hasattr(m, "gate"))]
    router_io = []
    handles += [r.register_forward_hook(lambda mod, a, o: router_io.append(o[0])) for r in routers.routers]
    replayer = RouteReplayer(moe)
    try:
        moe.zero_grad()
        with replayer.replay(routes, ids):
            replayed = _completion_log_probs(moe, ids, mask, 7)
        replayed.sum().backward()
    finally:
        replayer.remove()
        for h in handles:
            h.remove()
    assert len(seen) == routers.num_layers
    for layer, ((index, weights), logits) in enumerate(zip(seen, router_io)):
        want = torch.where(routes[:, :, layer] >= 0, routes[:, :, layer], own[:, :, layer]).reshape(-1, 2).long()
        assert torch.equal(index, want)
        expected = routers.family.gate_weights(routers.routers[layer], logits.detach(), want)
        assert torch.equal(weights, expected)
    assert not torch.allclose(replayed.detach(), _completion_log_probs(moe, ids, mask, 7).detach())
    for router in routers.routers:
        assert router.weight.grad is not None and torch.isfinite(router.weight.grad).all()
        assert router.weight.grad.abs().sum() > 0
    moe.zero_grad()


def test_replay_counts_mismatches_before_substitution():
    """Hand-built disagreements in the last MoE layer (so the model's own choices, computed before substitution,
    are those of a plain forward): counts per layer (selections) and per token (any layer), -1 tokens excluded."""
    model, _ = make_tiny_model("qwen3_moe", seed=0)
    ids, mask = _batch(rows=2, prompt=2, completion=3)
    own = _own_routes(model, ids, mask)  # (2 rows, 5 positions, 2 layers, k=2)
    routes = own.clone()

    def spare(row, pos, n):
        return [e for e in range(8) if e not in own[row, pos, 1].tolist()][:n]

    routes[0, 0, 1, 1] = spare(0, 0, 1)[0]  # one of two selections differs at (0, 0)
    routes[1, 2, 1] = torch.tensor(spare(1, 2, 2), dtype=routes.dtype)  # both differ at (1, 2)
    routes[1, 3, 1, 0] = spare(1, 3, 1)[0]  # one differs at (1, 3)
    routes[1, 4] = NO_ROUTE  # not counted
    counts = []
    replayer = RouteReplayer(model)
    try:
        with torch.no_grad(), replayer.replay(routes, ids, on_counts=counts.append):
            model(input_ids=ids, attention_mask=mask)
        with torch.no_grad(), replayer.replay(routes, ids, measure=False, on_counts=counts.append):
            model(input_ids=ids, attention_mask=mask)
    finally:
        replayer.remove()
    totals = {}
    for c in counts:
        for k, (n, d) in c.items():
            totals[k] = (totals.get(k, (0, 0))[0] + int(n), totals.get(k, (0, 0))[1] + int(d))
    tokens = 2 * 5 - 1
    assert totals == {
        "routing_mismatch_fraction/layer_0": (0, 2 * tokens),
        "routing_mismatch_fraction/layer_1": (4, 2 * tokens),
        "routing_mismatch_fraction": (4, 4 * tokens),
        "routing_token_mismatch_fraction": (3, tokens),  # (0, 0), (1, 2), (1, 3)
    }


def test_replay_follows_row_chunks_and_checks_alignment():
    model, _ = make_tiny_model("olmoe", seed=0)
    model.eval()
    ids, mask = _batch(seed=2)
    routes = _other_routes(_own_routes(model, ids, mask), 8, seed=5)
    with torch.no_grad():
        plain = _completion_log_probs(model, ids, mask, 7)
    replayer = RouteReplayer(model)
    try:
        with torch.no_grad():
            with replayer.replay(routes, ids):
                whole = _completion_log_probs(model, ids, mask, 7)
            with replayer.replay(routes, ids):  # TRL's chunked log-prob forward: rows 0-2, then row 3
                chunks = torch.cat([_completion_log_probs(model, ids[:3], mask[:3], 7),
                                    _completion_log_probs(model, ids[3:], mask[3:], 7)])
            assert torch.allclose(whole, chunks, atol=1e-6)
            with pytest.raises(ValueError, match="rows 0..1 of this forward are not the tokens of their routes"):
                with replayer.replay(routes, ids):
                    model(input_ids=ids[[1, 0]], attention_mask=mask[:2])
            with pytest.raises(RuntimeError, match="consumed 2 of 4 rows"):
                with replayer.replay(routes, ids):
                    model(input_ids=ids[:2], attention_mask=mask[:2])
            with pytest.raises(ValueError, match="expected \\(4, 12, 2, 2\\)"):
                with replayer.replay(routes[:, :, :1], ids):
                    pass
            with pytest.raises(ValueError, match="do not nest"):
                with replayer.replay(routes, ids), replayer.replay(routes, ids):
                    pass
            assert not torch.allclose(whole, plain)
            # outside a block (also after a failed one): the model routes itself again
            assert torch.equal(_completion_log_probs(model, ids, mask, 7), plain)
    finally:
        replayer.remove()


def test_a_deep_copy_of_the_model_carries_its_own_idle_replayer():
    """policy_lag_split's scratch copy (issue 22): a ``copy.deepcopy`` of a model with a replayer routes itself,
    although the original's last chunk is still current, and replays only in its own replayer's blocks."""
    model, _ = make_tiny_model("qwen3_moe", seed=0)
    model.eval()
    ids, mask = _batch(seed=3)
    routes = _other_routes(_own_routes(model, ids, mask), 8, seed=7)
    replayer = RouteReplayer(model)
    try:
        with torch.no_grad():
            plain = _completion_log_probs(model, ids, mask, 7)
            with replayer.replay(routes, ids):
                replayed = _completion_log_probs(model, ids, mask, 7)  # its chunk stays current after the block
            assert not torch.allclose(replayed, plain)
            scratch = copy.deepcopy(model)
            own = RouteReplayer.installed_on(scratch)
            assert RouteReplayer.installed_on(model) is replayer and own is not None and own is not replayer
            assert all(r.weight.data_ptr() != o.weight.data_ptr()
                       for r, o in zip(own.routers.routers, replayer.routers.routers))  # bound to the copy
            assert torch.equal(_completion_log_probs(scratch, ids, mask, 7), plain)
            with own.replay(routes, ids):
                assert torch.equal(_completion_log_probs(scratch, ids, mask, 7), replayed)
    finally:
        replayer.remove()
    assert RouteReplayer.installed_on(model) is None


def test_replay_under_gradient_checkpointing_recomputes_the_same_routes():
    """The backward's recompute (non-reentrant checkpointing) re-runs the routers after the replay block: it must
    replay the same routes, or the gradients would belong to another computation."""
    ids, mask = _batch(seed=3)
    grads = []
    for checkpointing in (False, True):
        model, _ = make_tiny_model("qwen3_moe", seed=0)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        routes = _other_routes(_own_routes(model, ids, mask), 8, seed=7)
        replayer = RouteReplayer(model)
        counts = []
        with replayer.replay(routes, ids, on_counts=counts.append):
            loss = _completion_log_probs(model, ids, mask, 7).sum()
        loss.backward()  # after the block, as the Trainer's training_step does
        replayer.remove()
        assert len(counts) == 2  # one count per layer: the recompute is not counted again
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- vLLM (GPU only)
def test_vllm_reader_on_constructed_outputs():
    """vLLM 0.32's CompletionOutput.routed_experts: (P + T - 1, num_hidden_layers, k) uint8; the MoE layers are
    picked (qwen2_moe: layer 1 of 2) and the last token gets no route."""
    model, _ = make_tiny_model("qwen2_moe", seed=0)
    routers = find_moe_routers(model)
    prompt, tokens = [2, 10, 11], [20, 21, 1]
    table = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8
    table[:, 1] = np.array([[3, 5], [0, 7], [1, 2], [6, 4], [5, 3]], dtype=np.uint8)
    completion = SimpleNamespace(token_ids=tokens, routed_experts=table)
    row = routes_from_vllm(completion, len(prompt), routers)
    expected = torch.full((6, 1, 2), NO_ROUTE, dtype=torch.int16)
    expected[:5, 0] = torch.tensor(table[:, 1].astype("int64"))
    assert torch.equal(row, expected)
    assert torch.equal(check_row_routes([row], [3], [3], routers)[0], expected)
    request = SimpleNamespace(prompt_token_ids=prompt, outputs=[completion, completion])
    assert [r.shape for r in routes_from_vllm_outputs([request, request], routers)] == [(6, 1, 2)] * 4
    with pytest.raises(ValueError, match="Row 2: vLLM returned no routed experts; start the engine with "):
        routes_from_vllm(SimpleNamespace(token_ids=tokens, routed_experts=None), 3, routers, row=2)
    with pytest.raises(ValueError, match="Row 0: vLLM routed experts of shape \\(4, 2, 2\\), expected \\(5, "):
        routes_from_vllm(SimpleNamespace(token_ids=tokens, routed_experts=table[1:]), 3, routers)
    with pytest.raises(ValueError, match="returned routes for 1 layers"):
        routes_from_vllm(SimpleNamespace(token_ids=tokens, routed_experts=table[:, :1]), 3, routers)


def test_routing_module_knows_no_trl():
    src = inspect.getsource(routing)
    assert "import trl" not in src and "from trl" not in src
