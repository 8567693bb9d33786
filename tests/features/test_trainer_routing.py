"""RolloutCorrGRPOTrainer with routing_replay="r3" on tiny random MoE models (CPU, no downloads): both modes train
with routes replayed, the routes stay with their rows through TRL's shuffle and split, the router gets gradients,
rollout_corr/routing_* are exact over micro-batches, the rollout_func path, and every error before the first step."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len
from trl_rollout_corr.routing import NO_ROUTE, find_moe_routers, record_routes
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

ROUTING_KEYS = ("rollout_corr/routing_mismatch_fraction", "rollout_corr/routing_mismatch_fraction/layer_0",
                "rollout_corr/routing_mismatch_fraction/layer_1", "rollout_corr/routing_token_mismatch_fraction")


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_olmoe")), "olmoe", seed=1)


def _count_calls(trainer) -> list:
    """Record every add_fraction_counts call (mode, {name: (num, den)} as ints) while keeping its effect."""
    calls, add = [], trainer.rollout_corr_metrics.add_fraction_counts

    def spy(mode, counts):
        calls.append((trainer.state.global_step, mode, {k: (int(n), int(d)) for k, (n, d) in counts.items()}))
        add(mode, counts)

    trainer.rollout_corr_metrics.add_fraction_counts = spy
    return calls


def _router_grad_sums(trainer) -> list:
    sums = []
    for router in find_moe_routers(trainer.model).routers:
        router.weight.register_hook(lambda g: sums.append(float(g.abs().sum())))
    return sums


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_routing_replay_trains_in_both_modes(mode, qwen3_moe_dir, tmp_path, make_trainer, step_logs):
    # (the counts are exact whatever their values; test_rollout_func_routes_are_replayed_and_counted_exactly checks
    # non-zero ones against a hand count)
    """bf16 rollout, float32 trainer: every step logs the exact mismatch counts of the forwards that measured them
    (decoupled: pi_old, once per generation batch; bypass: every pi_theta micro-batch) and the router gets a
    gradient through the replayed gate weights."""
    preset = dict(decoupled=dict(rollout_corr_preset="decoupled_token_is"),
                  bypass=dict(rollout_corr_preset="bypass_ppo_clip_k3_rs", rollout_rs_threshold="0.5"))[mode]
    trainer = make_trainer(qwen3_moe_dir, tmp_path, routing_replay="r3", rollout_generate_dtype="bfloat16",
                           max_steps=3, gradient_accumulation_steps=2, **preset)
    assert trainer.rollout_corr_router_replay.routers.layer_indices == (0, 1)
    calls, grads = _count_calls(trainer), _router_grad_sums(trainer)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 3 and all(math.isfinite(log["loss"]) for log in logs)
    # layers x (decoupled: pi_old's two row chunks of per_device_train_batch_size; bypass: two micro-batches)
    measured_per_step = 2 * 2
    for step, log in enumerate(logs):
        window = [c for s, m, c in calls if s == step and m == "train"]
        assert len(window) == measured_per_step
        for key in ROUTING_KEYS:
            name = key.removeprefix("rollout_corr/")
            num = sum(c[name][0] for c in window if name in c)
            den = sum(c[name][1] for c in window if name in c)
            assert den > 0 and log[key] == num / den, key
    assert len(grads) == 3 * 2 * 2 and all(math.isfinite(g) and g > 0 for g in grads)  # steps x micro x layers


def test_routes_stay_with_their_rows_through_shuffle_and_split(olmoe_dir, tmp_path, make_trainer):
    """steps_per_generation=2: TRL shuffles the generation batch and splits it into two micro-batches. Every
    micro-batch row carries the routes recorded for its own tokens; TRL's pi_old forward is skipped and pi_old is
    computed once per generation batch with the routes replayed."""
    recorded, checked = {}, []

    class Recording(RolloutCorrGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            for ids, mask, routes in zip(*self._row_views(output)):
                recorded.setdefault(ids, []).append(routes)  # identical completions of one prompt: both kept
            return output

        def _compute_loss(self, model, inputs):
            for ids, mask, routes in zip(*self._row_views(inputs)):
                checked.append(any(torch.equal(r, routes) for r in recorded[ids]))
            return super()._compute_loss(model, inputs)

        @staticmethod
        def _row_views(batch):
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
            keys = [tuple(row[m].tolist()) for row, m in zip(ids, mask)]
            return keys, mask, [r[m] for r, m in zip(batch["routed_experts"], mask)]

    trainer = make_trainer(olmoe_dir, tmp_path, trainer_cls=Recording, routing_replay="r3",
                           rollout_corr_preset="decoupled_token_is", steps_per_generation=2, max_steps=4)
    trainer.train()
    assert len(checked) == 4 * 4 and all(checked)  # 4 micro-batches of 4 rows, each its own routes
    assert trainer.rollout_corr_forward_counts["old_log_probs"] == 2  # ours, once per generation batch of 8 rows
    for routes in (r for rows in recorded.values() for r in rows):  # every real token routed but the last
        assert bool((routes[:-1] >= 0).all()) and bool((routes[-1] == NO_ROUTE).all() or (routes[-1] >= 0).all())


def test_float32_rollout_replays_without_mismatch(qwen3_moe_dir, tmp_path, make_trainer, step_logs):
    """Same numerics on both sides (float32 generate and trainer): the trainer's own routes are the recorded
    ones, so nothing is counted and the replayed pi_old equals the rollout's log-probs to float32 noise."""
    trainer = make_trainer(qwen3_moe_dir, tmp_path, routing_replay="r3", rollout_corr_preset="decoupled_token_is",
                           max_steps=2)
    trainer.train()
    for log in step_logs(trainer):
        assert all(log[key] == 0.0 for key in ROUTING_KEYS)
        assert abs(log["rollout_corr/kl"]) < 1e-5


def test_routing_replay_off_leaves_the_batch_alone(qwen3_moe_dir, tmp_path, make_trainer, step_logs):
    seen = []

    class Spy(RolloutCorrGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append("routed_experts" in inputs)
            return super()._compute_loss(model, inputs)

    trainer = make_trainer(qwen3_moe_dir, tmp_path, trainer_cls=Spy, rollout_corr_preset="decoupled_token_is",
                           max_steps=1)
    assert trainer.rollout_corr_router_replay is None and trainer.args.routing_replay == "off"
    trainer.train()
    assert seen == [False] and not [k for k in step_logs(trainer)[0] if "routing" in k]


def _rollout_func_from_generate(routes_fn=None):
    """A rollout_func standing in for an engine that returns routes (as a vLLM GPU one would): samples with the
    trainer's model through transformers.generate, records the routes, and returns them as 'routed_experts'."""
    from trl.trainer.grpo_trainer import disable_gradient_checkpointing

    from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        width = max(map(len, prompt_ids))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
        model = trainer.model
        with (  # generate with its KV cache, as an engine does (gradient checkpointing would switch it off)
            torch.no_grad(),
            disable_gradient_checkpointing(model, trainer.args.gradient_checkpointing_kwargs),
            capture_generate_log_probs(model) as cap,
            record_routes(find_moe_routers(model)) as rec,
        ):
            out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), do_sample=True,
                                 max_new_tokens=6, min_new_tokens=6, pad_token_id=tok.pad_token_id)
        completions = out[:, width:].tolist()
        routes = rec.generate_rows([len(p) for p in prompt_ids], [len(c) for c in completions])
        return {"prompt_ids": prompt_ids, "completion_ids": completions,
                "logprobs": cap.completion_log_probs(completions),
                **({} if routes_fn is None else {"routed_experts": routes_fn(routes)})}

    return rollout


def _perturb_last_layer(routes: list, every: int = 3) -> tuple:
    """Replace, at every ``every``-th routed token, the second expert of the last MoE layer by one outside the
    recorded pair: with float32 on both sides the trainer's own choice there is the recorded pair, so exactly one
    selection per perturbed token differs. Returns (perturbed rows as NumPy arrays, perturbed tokens, routed)."""
    out, perturbed, routed = [], 0, 0
    for r in routes:
        r = r.clone()
        for t in range(r.size(0)):
            if r[t, 0, 0] < 0:
                continue
            routed += 1
            if t % every == 0:
                r[t, -1, 1] = next(e for e in range(8) if e not in r[t, -1].tolist())
                perturbed += 1
        out.append(r.numpy())  # NumPy arrays, as vLLM returns them
    return out, perturbed, routed


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_rollout_func_routes_are_replayed_and_counted_exactly(mode, qwen3_moe_dir, tmp_path, make_args, step_logs):
    """A rollout_func returning 'routed_experts' (the path a vLLM GPU engine takes): the logged fractions are the
    hand-counted disagreements, over the two row chunks of pi_old (decoupled) or the two micro-batches (bypass)."""
    seen = []

    def perturb(routes):
        rows, perturbed, routed = _perturb_last_layer(routes)
        seen.append((perturbed, routed))
        return rows

    preset = "decoupled_token_is" if mode == "decoupled" else "bypass_ppo_clip"
    args = make_args(tmp_path, routing_replay="r3", rollout_corr_preset=preset, max_steps=1,
                     gradient_accumulation_steps=2)
    trainer = RolloutCorrGRPOTrainer(model=qwen3_moe_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(8),
                                     rollout_func=_rollout_func_from_generate(perturb))
    trainer.train()
    log = step_logs(trainer)[0]
    (perturbed, routed), = seen
    assert perturbed > 0
    assert log["rollout_corr/routing_mismatch_fraction/layer_0"] == 0.0
    assert log["rollout_corr/routing_mismatch_fraction/layer_1"] == perturbed / (2 * routed)
    assert log["rollout_corr/routing_mismatch_fraction"] == perturbed / (4 * routed)
    assert log["rollout_corr/routing_token_mismatch_fraction"] == perturbed / routed


def test_rollout_func_route_errors(qwen3_moe_dir, tmp_path, make_args):
    def trainer(routes_fn, name):
        args = make_args(tmp_path / name, routing_replay="r3", rollout_corr_preset="decoupled_token_is", max_steps=1)
        return RolloutCorrGRPOTrainer(model=qwen3_moe_dir, reward_funcs=reward_len, args=args,
                                      train_dataset=prompt_dataset(8),
                                      rollout_func=_rollout_func_from_generate(routes_fn))

    with pytest.raises(ValueError, match="a rollout_func must return 'routed_experts'"):
        trainer(None, "missing").train()
    with pytest.raises(ValueError, match="Row 2: routes of shape \\((\\d+), 1, 2\\), expected \\(\\1, 2, 2\\)"):
        trainer(lambda routes: [r if i != 2 else r[:, :1] for i, r in enumerate(routes)], "layers").train()
    with pytest.raises(ValueError, match="Row 0: token 3 of \\d+ has no route"):
        trainer(lambda routes: [r.index_fill(0, torch.tensor([3]), -1) for r in routes], "hole").train()


def test_routing_replay_errors_before_the_first_step(llama_dir, qwen3_moe_dir, tmp_path, make_args, make_trainer):
    with pytest.raises(ValueError, match="routing_replay must be one of \\('off', 'r3'\\), got 'R3'"):
        make_args(tmp_path, routing_replay="R3")
    with pytest.raises(ValueError, match="TRL's pi_old forward for it cannot replay"):
        make_args(tmp_path, routing_replay="r3", use_vllm=True)  # TRL's own vLLM IS defaults on without correction
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; llama has no MoE layer"):
        make_trainer(llama_dir, tmp_path, routing_replay="r3")
    args = make_args(tmp_path, routing_replay="r3", rollout_is="token", use_vllm=True)
    with pytest.raises(ValueError, match="TRL's own vLLM path does not return"):
        RolloutCorrGRPOTrainer(model=qwen3_moe_dir, reward_funcs=reward_len, args=args, train_dataset=prompt_dataset())
    with pytest.raises(ValueError, match="does not support tools"):
        RolloutCorrGRPOTrainer(model=qwen3_moe_dir, reward_funcs=reward_len, train_dataset=prompt_dataset(),
                               args=make_args(tmp_path, routing_replay="r3"), tools=[reward_len])


@pytest.mark.parametrize("generation_kwargs", [{"do_sample": False}, {"num_beams": 2}], ids=["greedy", "beam"])
def test_routing_replay_with_greedy_or_beam_generation_is_refused_at_config_time(generation_kwargs, tmp_path,
                                                                                make_args):
    """Routes are recorded from sampled generation only; without a correction TRL generates greedy/beam rows without
    the recorder, so r3 is refused when the config is built (not at the first step with a misleading message)."""
    with pytest.raises(ValueError, match=r"routing_replay='r3' with generation_kwargs=.*routing_replay='off'"):
        make_args(tmp_path, routing_replay="r3", generation_kwargs=generation_kwargs)
