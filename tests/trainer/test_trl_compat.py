"""trl_compat (the package, every module of it): the TRL 1.16 formulas the trainer mirrors, tested directly
(hand-computed values) and pinned to TRL's source and signatures (the ``test_trl_coupling_*`` tests fail loudly when
the pinned TRL changes)."""

from __future__ import annotations

import collections
import inspect
import math

import pytest
import torch
import trl
from trl import GRPOTrainer

from tiny_model import reward_len
from trl_rollout_corr import trl_compat
from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

# TRL's defaults for one reward function (GRPOConfig: scale_rewards="group", sum_then_normalize, weights 1).
ONE_REWARD = dict(
    reward_weights=torch.ones(1), multi_objective_aggregation="sum_then_normalize", scale_rewards="group"
)


# ---------------------------------------------------------------------------------------------- the package
@pytest.mark.unit
def test_trl_compat_package_re_exports_every_public_name():
    """``trl_compat`` is a package split by concern (issue 48) and callers write ``trl_compat.NAME``: every public
    name defined in any of its modules (found by listing the package, so a new module counts) is re-exported by
    ``trl_compat/__init__.py`` as the very same object, ``__all__`` lists exactly those names, and no name is defined
    in two modules."""
    import ast
    import importlib
    import pkgutil
    from pathlib import Path

    defined: dict[str, str] = {}
    for info in pkgutil.iter_modules(trl_compat.__path__):
        module = importlib.import_module(f"{trl_compat.__name__}.{info.name}")
        for node in ast.parse(Path(module.__file__).read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(t, ast.Name)]
            else:
                continue
            for name in names:
                if name.startswith("_"):
                    continue
                assert name not in defined, f"{name} is defined in both {defined[name]} and {info.name}"
                defined[name] = info.name
                assert getattr(trl_compat, name, None) is getattr(module, name), (
                    f"trl_compat.{name} is not {info.name}.{name}: re-export it in trl_compat/__init__.py")
    assert {"advantages", "loss", "lm_head", "sampling", "vllm_colocate", "vllm_server", "sharded",
            "trainer_state"} <= set(defined.values())
    assert sorted(trl_compat.__all__) == sorted(defined), set(trl_compat.__all__) ^ set(defined)


# ---------------------------------------------------------------------------------------------- TRL coupling pins
def test_trl_coupling_version_and_signatures():
    assert trl.__version__.startswith("1.16."), "trainer.py and trl_compat/ are written against trl 1.16"
    sig = {name: list(inspect.signature(getattr(GRPOTrainer, name)).parameters) for name in (
        "_generate_single_turn", "_generate", "_calculate_rewards", "_get_per_token_logps_and_entropies",
        "_generate_and_score_completions", "_compute_loss", "log")}
    assert sig["_generate_single_turn"] == [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]
    assert sig["_calculate_rewards"] == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert sig["_get_per_token_logps_and_entropies"][:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert sig["_compute_loss"] == ["self", "model", "inputs"]
    src_gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    src_loss = inspect.getsource(GRPOTrainer._compute_loss)
    src_single = inspect.getsource(GRPOTrainer._generate_single_turn)
    # (a)/(b): behaviour log-probs arrive as _generate()'s 5th value and become sampling_per_token_logps
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in src_gen
    assert "unwrapped_model.generate(" in src_single
    # (c): TRL's own pi_old rule, reproduced by _trl_computes_old_log_probs
    assert "self.args.gradient_accumulation_steps % generate_every != 0" in src_gen
    assert src_gen.index("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies") < src_gen.index(
        "ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies")
    # (d): rewards gathered, NaN rows excluded from the baseline, local slice by process index
    assert "self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in src_gen
    assert "advantages = torch.nan_to_num(advantages, nan=0.0)" in src_gen
    # (e): tool_mask enters only the loss mask; (B, T) advantages accepted; homogeneous clipped loss
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in src_loss
    assert "if advantages.dim() == 1:" in src_loss
    assert "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)" in src_loss
    assert src_loss.count("tool_mask") == 2  # both on that one line
    # transformers: the behaviour-log-prob recorder is appended to the list _get_logits_processor returns
    from transformers.generation.utils import GenerationMixin

    assert "generation_config" in inspect.signature(GenerationMixin._get_logits_processor).parameters


def test_trl_coupling_formulas_mirrored_in_trl_compat():
    """The TRL source lines behind each trl_compat function (see its module's header)."""
    src_gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    src_loss = inspect.getsource(GRPOTrainer._compute_loss)
    # group_advantages: unscorable rows NaN, the two aggregations, TRL's std epsilon, the per-process slice
    assert "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)" in src_gen
    assert 'if self.multi_objective_aggregation == "sum_then_normalize":' in src_gen
    assert 'elif self.multi_objective_aggregation == "normalize_then_sum":' in src_gen
    assert "advantages = advantages / (std_rewards + 1e-4)" in src_gen and trl_compat.ADVANTAGE_STD_EPS == 1e-4
    assert "self.accelerator.process_index * len(prompts)," in src_gen
    # replace_logged_advantages: the completions table gets the gathered advantages once per generation batch
    assert src_gen.count('self._logs["advantages"].extend(all_process_advantages.tolist())') == 1
    # prompt_completion_inputs / MULTIMODAL_FORWARD_KEYS: what _compute_loss passes to the log-prob forward
    assert "input_ids = torch.cat([prompt_ids, completion_ids], dim=1)" in src_loss
    assert "attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)" in src_loss
    forward_params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    for key in trl_compat.MULTIMODAL_FORWARD_KEYS:
        assert key in forward_params and f'{key}=inputs.get("{key}")' in src_loss, key
    # per_token_kl: k3 to pi_ref, bias-corrected by the policy ratio
    assert "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1" in src_loss
    assert "per_token_kl = per_token_kl * coef_1" in src_loss
    # aggregate_loss: the four normalisers and the accumulation scaling
    assert "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()" in src_loss
    assert "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)" in src_loss
    assert "loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)" in src_loss
    assert 'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes' in src_loss
    assert "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation" in (
        src_loss)
    # global_masked_mean: token-level sums reduced across processes
    assert "local_sum, local_count = (x * mask).sum(), mask.sum().float()" in src_loss
    assert 'totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")' in src_loss
    # clip_ratio_extremes: per-row masked means (NaN without tokens), gathered, nanmin / nanmax
    assert "return (x * mask).sum(-1) / mask.sum(-1)" in src_loss
    assert "gathered_low_clip = self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))" in src_loss
    assert '_metrics[mode]["clip_ratio/low_min"].append(nanmin(gathered_low_clip).item())' in src_loss
    assert "gathered_high_clip = self.accelerator.gather(masked_seq_mean(is_high_clipped.float()))" in src_loss
    assert '_metrics[mode]["clip_ratio/high_max"].append(nanmax(gathered_high_clip).item())' in src_loss
    # SUPPORTED_LOSS_TYPES["decoupled"]: every one of them is a branch of TRL's loss
    for loss_type in trl_compat.SUPPORTED_LOSS_TYPES["decoupled"]:
        assert f'"{loss_type}"' in src_loss, loss_type
    # check_vllm_server_logprobs: the client method it calls
    from trl.generation.vllm_client import VLLMClient

    assert "get_server_info" in vars(VLLMClient)


def test_trl_coupling_behind_the_drop_in_promise():
    """TRL internals the no-correction path, the no-args form, the flags, the bypass batch normalisation and the
    generate checks rely on (issue 9)."""
    import dataclasses

    from transformers import hf_argparser
    from trl import GRPOConfig

    src_init = inspect.getsource(GRPOTrainer.__init__)
    src_loss = inspect.getsource(GRPOTrainer._compute_loss)
    src_prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    src_tools = inspect.getsource(GRPOTrainer._tool_call_loop)
    # no args: TRL builds GRPOConfig("<last path part of the model id>-GRPO"); we build ours the same way
    assert 'args = GRPOConfig(f"{model_name}-GRPO")' in src_init
    assert 'model_name = model_name.split("/")[-1]' in src_init
    # no correction: OPSM falls back to pi_old when the batch has no sampling log-probs (so we must not add them)
    assert 'sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)' in src_loss
    # the plain generate path's sampling settings (``_plain_generate_has_no_mu`` reads do_sample / num_beams)
    assert "self.generation_config = GenerationConfig(**generation_kwargs, disable_compile=True)" in src_init
    # bypass batch normalisation: the micro-batch of micro-step k is the buffered chunk k % steps_per_generation,
    # regenerated every steps_per_generation * num_iterations micro-steps
    assert "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]" in src_prepare
    assert "if self._step % generate_every == 0 or self._buffered_inputs is None:" in src_prepare
    # multi-turn: the tool's answer gets behaviour log-prob 0.0 (never trained on: tool_mask 0)
    assert "logprobs[idx_with_tool] += [0.0] * tool_length + post_tool_logprobs[idx]" in src_tools
    # TRL's own vLLM IS settings whose change we refuse while a correction is on, and TRL's flag default
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert defaults["vllm_importance_sampling_correction"] is True
    assert {"vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_cap"} <= set(defaults)
    # transformers passes a field's metadata to argparse (bare booleans, the --no_ alias of our Optional[bool])
    src_field = inspect.getsource(hf_argparser.HfArgumentParser._parse_dataclass_field)
    assert "kwargs = field.metadata.copy()" in src_field and 'aliases = kwargs.pop("aliases", [])' in src_field


def test_trl_coupling_trainer_signature_and_our_names_do_not_shadow_trl():
    """The trainer binds its arguments to GRPOTrainer.__init__'s signature; its own private names are not TRL's."""
    params = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert params[:4] == ["self", "model", "reward_funcs", "args"]
    hooks = {"__init__", "_generate_single_turn", "_generate", "_calculate_rewards",
             "_get_per_token_logps_and_entropies", "_generate_and_score_completions", "_compute_loss", "log",
             "create_model_card", "_tag_names",  # the model card (trl_rollout_corr/model_card.py)
             "get_train_dataloader", "train",  # asynchronous generation (async_generation.py)
             "_push_from_checkpoint"}  # the features' state in a pushed checkpoint (checkpoint_state.py)
    ours = set(vars(RolloutCorrGRPOTrainer)) - hooks - {"__module__", "__qualname__", "__doc__", "__firstlineno__",
                                                         "__static_attributes__"}
    assert ours and not [name for name in ours if hasattr(GRPOTrainer, name)]
    assert hooks <= set(vars(RolloutCorrGRPOTrainer)) and all(hasattr(GRPOTrainer, name) for name in hooks)


def test_trl_coupling_batch_entries_follow_their_rows():
    """routing_replay's ``routed_experts`` (B, P + T, L, k) int16 rides in the generation batch dict: TRL 1.16's
    ``shuffle_sequence_dict`` / ``split_tensor_dict`` index every tensor with ndim >= 1 along dim 0 (in unison) and
    pass 0-d tensors unchanged, ``_prepare_inputs`` applies them in that order, a ``rollout_func``'s extra keys come
    back as ``_generate``'s 6th value, and ``_compute_loss`` runs one grad-mode forward per micro-batch (so the
    backward's gradient-checkpointing recompute belongs to the routes replayed last)."""
    from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, split_tensor_dict

    rows = 6
    prompt_ids = torch.arange(rows)[:, None].repeat(1, 3)
    routes = (torch.arange(rows)[:, None, None, None] * 10 + torch.zeros(1, 5, 2, 2, dtype=torch.long)).to(torch.int16)
    batch = {"prompt_ids": prompt_ids, "routed_experts": routes, "rollout_generation_step": torch.tensor(3)}
    torch.manual_seed(0)
    shuffled = shuffle_sequence_dict(split_pixel_values_by_grid(batch))
    assert shuffled["prompt_ids"][:, 0].tolist() != list(range(rows))  # really permuted (seed 0)
    for part in [shuffled, *split_tensor_dict(shuffled, 2)]:
        assert part["routed_experts"].dtype == torch.int16 and part["routed_experts"].shape[1:] == (5, 2, 2)
        assert torch.equal(part["routed_experts"][:, :, 0, 0].long(), part["prompt_ids"][:, :1].repeat(1, 5) * 10)
        assert part["rollout_generation_step"].item() == 3
    assert [len(p["prompt_ids"]) for p in split_tensor_dict(shuffled, 2)] == [3, 3]
    src_prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    calls = ("self._generate_and_score_completions(generation_batch)", "shuffle_sequence_dict(generation_batch)",
             "split_tensor_dict(generation_batch, self.args.steps_per_generation)")
    assert all(c in src_prepare for c in calls) and sorted(calls, key=src_prepare.index) == list(calls)
    src_generate = inspect.getsource(GRPOTrainer._generate)
    assert "extra_fields = {k: v for k, v in output.items() if k not in required_keys}" in src_generate
    assert ("return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images"
            in src_generate)
    src_loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert src_loss.count("self._get_per_token_logps_and_entropies(") == 1 and "batch_size=" not in src_loss
    src_forward = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert 'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}' in src_forward
    assert src_forward.count("outputs = model(**model_inputs") == 1
    # generate runs with gradient checkpointing off (its KV cache on: a prefill, then one position per step)
    assert "gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs" in inspect.getsource(
        GRPOTrainer._generate_single_turn)


def test_trl_coupling_our_batch_keys_may_come_in_any_order():
    """The order of our keys in the generation batch is free: TRL 1.16's ``shuffle_sequence_dict`` draws one
    ``randperm`` sized by the first non-None value and ``split_tensor_dict`` takes its chunk size from the first
    tensor, and that first key is TRL's ``prompt_ids`` (it builds the dict; we only add keys after it, a trained
    batch's first key is checked in ``test_trainer_golden``). Reordering the keys after it changes nothing."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    rows = 6
    ours = {"rollout_log_probs": torch.arange(rows * 2.0).reshape(rows, 2),
            "rollout_policy_version": torch.arange(rows),
            "rollout_generation_step": torch.tensor(4), "rollout_support": [f"kept{i}" for i in range(rows)]}
    parts = []
    for order in (list(ours), list(reversed(ours))):
        batch = {"prompt_ids": torch.arange(rows)[:, None].repeat(1, 3), **{k: ours[k] for k in order}}
        torch.manual_seed(0)
        shuffled = shuffle_sequence_dict(batch)
        parts.append(split_tensor_dict(shuffled, 3))
    assert parts[0][0]["prompt_ids"][:, 0].tolist() != [0, 1]  # really permuted (seed 0)
    for a, b in zip(*parts):
        assert a.keys() == b.keys() and len(a["prompt_ids"]) == 2
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert a["rollout_policy_version"].tolist() == a["prompt_ids"][:, 0].tolist()  # rows stay together


@pytest.mark.parametrize("setting", [
    dict(scale_rewards="group"), dict(scale_rewards="batch"), dict(scale_rewards="none"),
    dict(multi_objective_aggregation="normalize_then_sum"),
])
def test_trl_coupling_advantage_formula_matches_trl(setting, llama_dir, tmp_path, make_trainer):
    """With nothing rejected, group_advantages reproduces TRL's advantages exactly (bit for bit)."""
    rewards_seen, advantages_seen = [], []

    class Spy(RolloutCorrGRPOTrainer):
        def _calculate_rewards(self, *args):
            rewards = super()._calculate_rewards(*args)
            rewards_seen.append(rewards.clone())
            return rewards

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            advantages_seen.append(out["advantages"].clone())
            return out

    def reward_digits(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    trainer = make_trainer(llama_dir, tmp_path, trainer_cls=Spy, reward_funcs=[reward_len, reward_digits],
                           rollout_corr_preset="decoupled_token_is", max_steps=2, **setting)
    trainer.train()
    assert len(rewards_seen) == len(advantages_seen) == 2
    for advantages, rewards in zip(advantages_seen, rewards_seen):
        ours = trl_compat.group_advantages(
            rewards, torch.zeros(rewards.size(0), dtype=torch.bool), reward_weights=trainer.reward_weights,
            num_generations=4, multi_objective_aggregation=trainer.multi_objective_aggregation,
            scale_rewards=trainer.scale_rewards,
        )
        torch.testing.assert_close(ours, advantages, atol=0, rtol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_coupling_bypass_aggregation_matches_trl_loss(loss_type, llama_dir, tmp_path, make_trainer, loss_inputs):
    """Bypass ppo_clip without IS/RS == TRL's own loss with old_per_token_logps := mu (incl. beta KL,
    bias-corrected)."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_corr_preset="bypass_ppo_clip", loss_type=loss_type, beta=0.04,
                           gradient_accumulation_steps=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs, logp, log_direct = loss_inputs(trainer, [[3.0, 1.1, 0.7], [0.9, 1.3, 1.0]], [1.0, -0.5])
    mu = logp - log_direct
    inputs.update(rollout_log_probs=mu, ref_per_token_logps=logp + torch.tensor([[0.1, -0.2, 0.3], [0.05, 0.0, 0.0]]))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    ours = trainer._compute_loss(trainer.model, inputs)
    grads_ours = torch.autograd.grad(ours, params)
    theirs = GRPOTrainer._compute_loss(trainer, trainer.model, {**inputs, "old_per_token_logps": mu})
    grads_theirs = torch.autograd.grad(theirs, params)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- advantages
@pytest.mark.unit
def test_fully_rejected_row_gets_zero_advantage_and_leaves_baseline():
    rewards = torch.tensor([[1.0], [0.0], [1.0], [5.0], [2.0], [2.0], [0.0], [4.0]])
    excluded = torch.tensor([False, False, False, True, False, False, False, False])
    adv = trl_compat.group_advantages(rewards, excluded, num_generations=4, **ONE_REWARD)
    # group 0 without row 3: rewards [1, 0, 1], mean 2/3, unbiased std 0.577350
    std0 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    expected0 = [(1 - 2 / 3) / (std0 + 1e-4), (0 - 2 / 3) / (std0 + 1e-4), (1 - 2 / 3) / (std0 + 1e-4), 0.0]
    torch.testing.assert_close(adv[:4], torch.tensor(expected0), atol=1e-6, rtol=0)
    # the baseline equals that of the group without the row at all
    alone = trl_compat.group_advantages(torch.tensor([[1.0], [0.0], [1.0]]), torch.zeros(3, dtype=torch.bool),
                                        num_generations=3, **ONE_REWARD)
    torch.testing.assert_close(adv[:3], alone)
    # group 1 untouched: rewards [2, 2, 0, 4], mean 2, std sqrt(8/3)
    std1 = math.sqrt(8 / 3)
    torch.testing.assert_close(adv[4:], torch.tensor([0.0, 0.0, -2 / (std1 + 1e-4), 2 / (std1 + 1e-4)]),
                               atol=1e-6, rtol=0)

    # through advantages_after_rejection (one process) with and without keeping the row in the baseline
    def after(advantages, rejected, keep):
        return trl_compat.advantages_after_rejection(
            advantages, rejected, rewards, keep_rejected_in_baseline=keep, process_index=0, num_generations=4,
            **ONE_REWARD).local

    trl_adv = trl_compat.group_advantages(rewards, torch.zeros(8, dtype=torch.bool), num_generations=4, **ONE_REWARD)
    torch.testing.assert_close(after(trl_adv, excluded, False), adv)
    kept = after(trl_adv, excluded, True)
    assert kept[3] == 0.0
    torch.testing.assert_close(kept[:3], trl_adv[:3])  # verl: rejected row still shapes the baseline
    # nothing rejected anywhere: TRL's advantages are returned as they are
    assert after(trl_adv, torch.zeros(8, dtype=torch.bool), False) is trl_adv


@pytest.mark.unit
def test_group_advantages_other_settings_by_hand():
    rewards = torch.tensor([[1.0], [3.0], [float("nan")], [0.0], [2.0], [4.0]])  # row 2: no reward function scored it
    none = torch.zeros(6, dtype=torch.bool)
    # scale_rewards="none": centred only; the unscorable row is out of its group's mean and gets 0
    adv = trl_compat.group_advantages(rewards, none, reward_weights=torch.ones(1), num_generations=3,
                                      multi_objective_aggregation="sum_then_normalize", scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, -2.0, 0.0, 2.0]))
    # scale_rewards="batch" with row 5 excluded: mean per group, std over the batch's 4 remaining scored rows
    excluded = torch.tensor([False, False, False, False, False, True])
    adv = trl_compat.group_advantages(rewards, excluded, reward_weights=torch.ones(1), num_generations=3,
                                      multi_objective_aggregation="sum_then_normalize", scale_rewards="batch")
    std = torch.tensor([1.0, 3.0, 0.0, 2.0]).std().item()  # unbiased, as TRL's nanstd
    expected = torch.tensor([-1.0, 1.0, 0.0, -1.0, 1.0, 0.0]) / (std + 1e-4)
    expected[2] = 0.0
    torch.testing.assert_close(adv, expected)
    # normalize_then_sum, two functions with weights (1, 2), one group of two rows
    two = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    adv = trl_compat.group_advantages(two, torch.zeros(2, dtype=torch.bool), reward_weights=torch.tensor([1.0, 2.0]),
                                      num_generations=2, multi_objective_aggregation="normalize_then_sum",
                                      scale_rewards="group")
    z = 1 / (math.sqrt(2) + 1e-4)  # each function: (x - mean) / (std + eps) = -+1/sqrt(2) scaled
    summed = torch.tensor([-3 * z, 3 * z])
    torch.testing.assert_close(adv, summed / (summed.std() + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        trl_compat.group_advantages(rewards, none, reward_weights=torch.ones(1), num_generations=3,
                                    multi_objective_aggregation="sum_then_normalize", scale_rewards="rank")
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        trl_compat.group_advantages(rewards, none, reward_weights=torch.ones(1), num_generations=3,
                                    multi_objective_aggregation="max", scale_rewards="group")


@pytest.mark.unit
def test_advantages_after_rejection_slices_this_process_rows():
    # 2 processes x 4 rows, one group of 4 per process; process 1's row 5 (global) is rejected
    rewards = torch.tensor([[1.0], [0.0], [1.0], [5.0], [2.0], [2.0], [0.0], [4.0]])
    rejected = torch.zeros(8, dtype=torch.bool)
    rejected[5] = True
    trl_adv = trl_compat.group_advantages(rewards, torch.zeros(8, dtype=torch.bool), num_generations=4, **ONE_REWARD)
    out = {}
    for rank in (0, 1):
        out[rank] = trl_compat.advantages_after_rejection(
            trl_adv[4 * rank : 4 * rank + 4], rejected, rewards, keep_rejected_in_baseline=False,
            process_index=rank, num_generations=4, **ONE_REWARD)
    full = trl_compat.group_advantages(rewards, rejected, num_generations=4, **ONE_REWARD)
    torch.testing.assert_close(torch.cat([out[0].local, out[1].local]), full)
    torch.testing.assert_close(out[0].all_processes, full)
    torch.testing.assert_close(out[0].local, trl_adv[:4])  # the other group is untouched
    assert out[1].local[1] == 0.0
    # without rewards (unknown), only the rejected row is zeroed
    blind = trl_compat.advantages_after_rejection(trl_adv[4:], rejected, None, keep_rejected_in_baseline=False,
                                                  process_index=1, num_generations=4, **ONE_REWARD)
    assert blind.all_processes is None and blind.local.tolist() == [trl_adv[4].item(), 0.0, *trl_adv[6:].tolist()]


@pytest.mark.unit
def test_replace_logged_advantages_rewrites_the_last_batch():
    logged = collections.deque([9.0, 1.0, 2.0, 3.0], maxlen=5)
    trl_compat.replace_logged_advantages(logged, torch.tensor([0.5, 0.0, -0.5]))
    assert list(logged) == [9.0, 0.5, 0.0, -0.5]
    short = [1.0]
    trl_compat.replace_logged_advantages(short, torch.tensor([0.5, 0.0]))
    assert short == [0.5, 0.0]


@pytest.mark.unit
def test_lone_survivors_by_hand():
    # groups of 2: (rejected, kept) -> the kept row is alone; (kept, kept); (rejected, rejected); (kept, no tokens)
    rejected = torch.tensor([True, False, False, False, True, True, False, False])
    has_tokens = torch.tensor([True, True, True, True, True, True, True, False])
    lone = trl_compat.lone_survivors(rejected, has_tokens, num_generations=2)
    assert lone.tolist() == [False, True, False, False, False, False, False, False]
    # groups of 4: one kept among three rejected
    lone = trl_compat.lone_survivors(torch.tensor([True, True, False, True]), torch.ones(4, dtype=torch.bool), 4)
    assert lone.tolist() == [False, False, True, False]


@pytest.mark.unit
def test_trl_computes_old_log_probs_rule():
    def rule(ga, spg, iters, vllm=False, vllm_is=False):
        return trl_compat.trl_computes_old_log_probs(
            gradient_accumulation_steps=ga, steps_per_generation=spg, num_iterations=iters, use_vllm=vllm,
            vllm_importance_sampling_correction=vllm_is)

    assert not rule(1, 1, 1) and not rule(4, 2, 2) and not rule(2, 1, 2)
    assert rule(1, 2, 1) and rule(1, 1, 2) and rule(2, 4, 1)  # data reused after an optimizer step
    assert rule(1, 1, 1, vllm=True, vllm_is=True) and not rule(1, 1, 1, vllm=True, vllm_is=False)


# ---------------------------------------------------------------------------------------------- loss inputs
@pytest.mark.unit
def test_loss_mask_and_forward_inputs():
    batch = dict(prompt_ids=torch.tensor([[1, 2]]), prompt_mask=torch.tensor([[0, 1]]),
                 completion_ids=torch.tensor([[3, 4, 5]]), completion_mask=torch.tensor([[1, 1, 0]]),
                 pixel_values=torch.zeros(1, 3), unrelated=1)
    assert trl_compat.loss_mask(batch).tolist() == [[1, 1, 0]]
    assert trl_compat.loss_mask({**batch, "tool_mask": torch.tensor([[1, 0, 1]])}).tolist() == [[1, 0, 0]]
    fwd = trl_compat.prompt_completion_inputs(batch)
    assert fwd.input_ids.tolist() == [[1, 2, 3, 4, 5]] and fwd.attention_mask.tolist() == [[0, 1, 1, 1, 0]]
    assert fwd.logits_to_keep == 3 and list(fwd.multimodal) == ["pixel_values"]


def _trl_clipped_loss(log_ratio, advantages, eps=0.2):
    """TRL's grpo per-token loss, -min(r A, clip(r) A), written out."""
    ratio = torch.exp(log_ratio)
    return -torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)


@pytest.mark.unit
def test_inject_rs_mask_and_is_weights():
    batch = dict(advantages=torch.tensor([1.0, -0.5]), completion_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                 rollout_rs_mask=torch.tensor([[0, 1, 1], [1, 0, 0]]),
                 rollout_is_weights=torch.tensor([[2.0, 1.5, 0.0], [1.2, 0.25, 1.0]]))
    out = trl_compat.inject_rs_mask_and_is_weights(batch)
    assert out["tool_mask"] is batch["rollout_rs_mask"] and out["completion_mask"] is batch["completion_mask"]
    torch.testing.assert_close(out["advantages"], torch.tensor([[2.0, 1.5, 0.0], [-0.6, -0.125, -0.5]]))
    assert batch["advantages"].shape == (2,) and "tool_mask" not in batch  # the input is not modified
    assert trl_compat.loss_mask(out).tolist() == [[0, 1, 1], [1, 0, 0]]
    # W * loss(A) == loss(W * A) for TRL's clipped loss and W >= 0 (W = 0: IcePop outside the band)
    log_ratio = torch.tensor([[0.5, -0.5, 0.1], [0.3, -0.3, 0.0]])
    weights, adv2d = batch["rollout_is_weights"], batch["advantages"].unsqueeze(1)
    torch.testing.assert_close(_trl_clipped_loss(log_ratio, out["advantages"]),
                               weights * _trl_clipped_loss(log_ratio, adv2d))
    # without IS weights only the mask changes
    plain = trl_compat.inject_rs_mask_and_is_weights({k: v for k, v in batch.items() if k != "rollout_is_weights"})
    assert plain["advantages"] is batch["advantages"]
    with pytest.raises(KeyError):
        trl_compat.inject_rs_mask_and_is_weights({"advantages": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------- loss aggregation
@pytest.mark.unit
def test_per_token_kl_by_hand():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, float("nan")]])  # NaN at a padded position never leaks
    keep = torch.tensor([[True, True, False]])
    kl = trl_compat.per_token_kl(lp, ref, keep)
    torch.testing.assert_close(kl.detach(), torch.tensor([[math.exp(-0.5) + 0.5 - 1, 0.0, 0.0]]))
    old = torch.tensor([[-1.0 - math.log(2.0), -2.0, float("nan")]])  # ratio pi_theta / pi_old = [2, 1]
    corrected = trl_compat.per_token_kl(lp, ref, keep, bias_correction_old_log_probs=old)
    torch.testing.assert_close(corrected.detach(), kl.detach() * torch.tensor([[2.0, 1.0, 1.0]]))
    corrected.sum().backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.unit
@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", ((1 + 2) / 2 + 4 / 1) / 2 / 2),  # mean over rows of the row token means, / accumulation
    ("bnpo", (1 + 2 + 4) / 3 / 2),  # token mean over the micro-batch, / accumulation
    ("dr_grpo", (1 + 2 + 4) / (2 * 4) / 2),  # sum / (B * max_completion_length), / accumulation
    ("dapo", (1 + 2 + 4) / (10 / 2 * 2 / 4)),  # sum / (global tokens / processes * accumulation / steps_per_gen)
])
def test_aggregate_loss_per_loss_type(loss_type, expected):
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])  # NaN outside the mask never leaks
    keep = torch.tensor([[True, True, False], [True, False, False]])
    loss = trl_compat.aggregate_loss(per_token, keep, loss_type, accumulation_steps=2, max_completion_length=4,
                                     num_items_in_batch=torch.tensor(10.0), num_processes=2, steps_per_generation=4)
    assert loss.item() == pytest.approx(expected)


@pytest.mark.unit
def test_aggregate_loss_edge_cases():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    loss = trl_compat.aggregate_loss(torch.ones(2, 3), empty, "grpo", accumulation_steps=1, max_completion_length=3)
    assert loss.item() == 0.0  # counts clamp at 1: an all-rejected micro-batch has loss 0, not NaN
    with pytest.raises(ValueError, match="num_items_in_batch"):
        trl_compat.aggregate_loss(torch.ones(2, 3), empty, "dapo", accumulation_steps=1, max_completion_length=3)
    with pytest.raises(ValueError, match="supports loss_type in"):
        trl_compat.aggregate_loss(torch.ones(2, 3), empty, "cispo", accumulation_steps=1, max_completion_length=3)


@pytest.mark.unit
def test_wrap_optimizer_step_skips_when_not_allowed():
    """skip_empty_steps' hook: the Trainer calls ``self.optimizer.step()`` once per optimizer step (pinned here); the
    wrapper skips it when ``allow()`` is False (parameters and AdamW state untouched) and wraps an optimizer once."""
    from transformers import Trainer

    assert inspect.getsource(Trainer._run_epoch).count("self.optimizer.step()") == 1
    assert "self.optimizer.step()" not in inspect.getsource(Trainer._inner_training_loop)
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.tensor([0.5, 0.5])
    optimizer.step()  # a real step first: AdamW now has momentum
    after_first = param.detach().clone()
    decisions = []
    trl_compat.wrap_optimizer_step(optimizer, lambda: decisions.append(len(decisions)) or len(decisions) > 1)
    trl_compat.wrap_optimizer_step(optimizer, lambda: True)  # a second wrap is a no-op
    param.grad = torch.zeros(2)
    optimizer.step()  # skipped
    assert torch.equal(param.detach(), after_first) and optimizer.state[param]["step"].item() == 1
    optimizer.step()  # allowed: momentum moves the parameter on a zero gradient
    assert not torch.equal(param.detach(), after_first) and optimizer.state[param]["step"].item() == 2
    assert decisions == [0, 1]


@pytest.mark.unit
def test_clip_ratio_extremes_by_hand():
    """Issue 44 (minor): bypass logs TRL's clip_ratio/low_min and high_max. Rows' kept tokens: 2, 3 and none; low
    clipped 1 of 2 and 2 of 3 (the third row's flags are outside the loss): min 0.5; high clipped 0 of 2 and 1 of 3:
    max 1/3. A second rank whose row is all high-clipped raises the max to 1; no kept token anywhere gives NaN."""
    keep = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]]).bool()
    low = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1]]).bool()
    high = torch.tensor([[0, 0, 1], [0, 0, 1], [1, 1, 1]]).bool()
    low_min, high_max = trl_compat.clip_ratio_extremes(low, high, keep, lambda t: t)
    assert low_min == 0.5 and high_max == pytest.approx(1 / 3, abs=1e-7)
    rank2 = lambda t: torch.cat([t, torch.tensor([1.0])])  # noqa: E731  (another rank: one row, fraction 1)
    assert trl_compat.clip_ratio_extremes(low, high, keep, rank2) == (0.5, 1.0)
    assert all(math.isnan(v) for v in trl_compat.clip_ratio_extremes(low, high, keep & False, lambda t: t))


@pytest.mark.unit
def test_global_masked_mean():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert trl_compat.global_masked_mean(values, keep) == pytest.approx(2.0)
    # two ranks with the same tokens: the sums double, the mean does not change
    assert trl_compat.global_masked_mean(values, keep, reduce_sum=lambda t: 2 * t) == pytest.approx(2.0)
    other_rank = torch.tensor([10.0, 1.0])  # a rank holding one token of value 10
    assert trl_compat.global_masked_mean(values, keep, reduce_sum=lambda t: t + other_rank) == pytest.approx(4.0)
    assert trl_compat.global_masked_mean(values, torch.zeros_like(keep)) == 0.0


@pytest.mark.unit
def test_check_vllm_server_logprobs():
    class Client:
        def __init__(self, mode):
            self.mode = mode

        def get_server_info(self):
            return {"model_config": {"logprobs_mode": self.mode}}

    trl_compat.check_vllm_server_logprobs(Client("processed_logprobs"))
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        trl_compat.check_vllm_server_logprobs(Client("raw_logprobs"))


# ---------------------------------------------------------------------------------------------- the training forward
def test_training_log_probs_are_the_trainers_forward(llama_dir, tmp_path, make_trainer):
    """``trl-rollout-corr probe`` scores tokens with ``trl_compat.training_log_probs`` on a model patched as TRL
    patches the policy: bit for bit the trainer's own ``_get_per_token_logps_and_entropies`` (float32), with TRL's
    labels rule and fused-head call pinned."""
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(llama_dir, tmp_path, temperature=0.7)
    prompt = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [4, 5, 6, 7]])  # left-padded (pad id 0)
    completion = torch.tensor([[10, 11, 12], [13, 1, 0], [14, 0, 0]])  # right-padded
    ids = torch.cat([prompt, completion], 1)
    mask = torch.cat([(prompt != 0).long(), torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])], 1)
    with torch.no_grad():
        expected, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
        model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
        trl_compat.add_training_lm_head(model, temperature=0.7)
        got = trl_compat.training_log_probs(model, ids, mask, 3)
    assert torch.equal(got, expected)
    assert got[1, 2] == 0.0 and got[2, 1:].eq(0).all()  # padding scores 0
    # and it is the temperature-scaled full-vocabulary log-softmax (an independent forward)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -4:-1].float() / 0.7
    reference = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got[0], reference[0], atol=1e-5)
    src = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)" in src
    assert "labels[:, :-logits_to_keep] = -100" in src
    assert "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)" in src
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "temperature=self.temperature,\n            cast_lm_head_to_fp32=args.cast_lm_head_to_fp32," in init
# ---------------------------------------------------------------------------------------------- sampling support
def test_trl_coupling_support_matching_pins():
    """What support matching relies on in TRL 1.16 and transformers 5 (see trl_compat's sampler helpers)."""
    import transformers
    from transformers.generation.utils import GenerationMixin
    from trl.generation import vllm_generation
    from trl.models import utils as trl_model_utils
    from trl.trainer import utils as trl_utils

    # the log-prob forward: one model call per row chunk, in row order, the prompt masked out of the labels
    src_fwd = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "for start in range(0, input_ids.size(0), batch_size):" in src_fwd
    assert "labels[:, :-logits_to_keep] = -100" in src_fwd
    assert "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)" in src_fwd
    assert "all_logps.append(outputs.log_probs[:, -logits_to_keep:])" in src_fwd
    # the fused head: the backbone called by keyword, its last hidden state shifted by one, the output embeddings
    src_head = inspect.getsource(trl_utils.add_fused_lm_head)
    assert 'backbone_attr = "base_model"' in src_head
    assert "backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)" in src_head
    assert "hidden_states = backbone_outputs.last_hidden_state[:, :-1]" in src_head
    assert "lm_head = self.get_output_embeddings()" in src_head
    for name in trl_compat.LOGIT_TRANSFORM_FIELDS:  # every logit rescaling the head applies is refused by us
        assert f'"{name}"' in src_head, name
    # TRL's samplers: the GRPOConfig fields they take, generation_kwargs on top
    src_init = inspect.getsource(GRPOTrainer.__init__)
    for name in trl_compat.SAMPLER_ARGS:
        assert f'"{name}": self.{name},' in src_init and f"{name}=self.{name}," in src_init, name
    assert "generation_kwargs.update(args.generation_kwargs)" in src_init
    assert "self.generation_config = GenerationConfig(**generation_kwargs, disable_compile=True)" in src_init
    src_vllm = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    assert '"min_p": 0.0 if min_p is None else min_p,' in src_vllm
    assert "generation_kwargs.update(self.generation_kwargs)" in src_vllm
    # transformers 5: generate fills the caller's None fields from the model's generation config; TRL overrides
    # nothing on the model under transformers 5
    assert transformers.__version__.startswith("5.")
    assert list(inspect.signature(GenerationMixin._prepare_generation_config).parameters)[:2] == [
        "self", "generation_config"]
    src_prepare = inspect.getsource(GenerationMixin._prepare_generation_config)
    assert "generation_config.update(**self.generation_config.to_dict(), defaults_only=True" in src_prepare
    assert 'Version(transformers.__version__) >= Version("5.0.0")' in inspect.getsource(
        trl_model_utils._override_model_generation_config)


def test_vllm_sampling_kwargs_and_sources():
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    kwargs = trl_compat.vllm_sampling_kwargs(temperature=0.9, top_p=0.8, top_k=0, min_p=None, repetition_penalty=1.0,
                                             max_tokens=16, generation_kwargs={"top_k": 5, "seed": 1})
    assert kwargs == {"n": 1, "repetition_penalty": 1.0, "temperature": 0.9, "top_p": 0.8, "top_k": 5, "min_p": 0.0,
                      "max_tokens": 16, "logprobs": 0, "seed": 1}
    args = RolloutCorrGRPOConfig("out", use_cpu=True, report_to=[], generation_kwargs={"top_k": 5})
    assert trl_compat.sampler_sources(args, args.generation_kwargs) == {
        "temperature": "RolloutCorrGRPOConfig.temperature", "top_p": "RolloutCorrGRPOConfig.top_p",
        "top_k": "generation_kwargs", "repetition_penalty": "RolloutCorrGRPOConfig.repetition_penalty"}


# ---------------------------------------------------------------------------------------------- the fast paths
def test_trl_coupling_compact_scoring_hook():
    """``score_trained_tokens_only`` swaps the one name TRL's fused head consults to choose compact scoring."""
    import trl.trainer.utils as trl_utils

    src = inspect.getsource(trl_utils.add_fused_lm_head)
    assert "compact = _use_triton(hidden_states.device)" in src
    assert "hidden_states[mask] if compact else hidden_states.reshape(-1, hidden_states.size(-1))" in src
    assert "x.new_zeros(mask.shape).masked_scatter(mask, x)" in src
    assert "_use_triton" in trl_utils.add_fused_lm_head.__globals__  # looked up at call time, in this module
    assert inspect.getsource(trl_utils).count("_use_triton(") == 1  # nothing else in the module consults it
    cpu, trl_choice = torch.device("cpu"), trl_utils._use_triton
    assert trl_choice(cpu) is False  # TRL 1.16 scores every position on CPU
    with trl_compat.score_trained_tokens_only():
        assert trl_utils._use_triton(cpu) is True
        with trl_compat.score_trained_tokens_only(enabled=False):
            assert trl_utils._use_triton(cpu) is True  # disabled: leaves the current choice alone
    assert trl_utils._use_triton is trl_choice
    # GRPOTrainer's forwards pass labels -100 outside the completion and at padding: the compact rows
    src_fwd = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)" in src_fwd
    assert "labels[:, :-logits_to_keep] = -100" in src_fwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_scoring_equals_trls_full_scoring_and_the_logits(dtype, llama_dir):
    """Log-probs, entropies and gradients of TRL's fused head with trained-token-only scoring equal TRL's own
    full scoring (bit for bit) and TRL's ``selective_log_softmax`` / ``entropy_from_logits`` on the logits."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head, entropy_from_logits, selective_log_softmax

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=dtype)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    gen = torch.Generator().manual_seed(0)
    B, P, T = 5, 6, 9
    ids = torch.randint(3, 40, (B, P + T), generator=gen)
    attn = torch.ones_like(ids)
    attn[:2, :3] = 0  # left-padded prompts
    attn[2, P + 4:] = 0  # right-padded completions
    attn[3, P + 1:] = 0
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-T] = -100
    weights = torch.linspace(-1.0, 1.0, T)

    def score(compact):
        model.zero_grad()
        with trl_compat.score_trained_tokens_only(enabled=compact):
            out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        lp, ent = out.log_probs[:, -T:], out.entropy[:, -T:]
        (lp.float() * weights).sum().backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]

    full, compact = score(False), score(True)
    assert torch.equal(full[0], compact[0]) and torch.equal(full[1], compact[1])
    assert all(torch.equal(a, b) for a, b in zip(full[2], compact[2]))
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float() / 0.7
    trained = (attn[:, P:] == 1)
    expected_lp = selective_log_softmax(logits, ids[:, P:])
    expected_ent = entropy_from_logits(logits)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(compact[0][trained].float(), expected_lp[trained], atol=tol)
    assert torch.allclose(compact[1][trained].float(), expected_ent[trained], atol=tol)
    assert torch.all(compact[0][~trained] == 0) and torch.all(compact[1][~trained] == 0)


def test_trl_coupling_skip_fused_lm_head_pin():
    """``skip_fused_lm_head`` swaps the one name TRL's fused head calls to project the hidden states."""
    import trl.trainer.utils as trl_utils

    src = inspect.getsource(trl_utils.add_fused_lm_head)
    assert src.count("_ChunkedLogProbFunction.apply(") == 1
    assert "log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token" in src
    assert "_ChunkedLogProbFunction" in trl_utils.add_fused_lm_head.__globals__  # looked up at call time
    trl_head = trl_utils._ChunkedLogProbFunction
    with pytest.raises(RuntimeError):
        with trl_compat.skip_fused_lm_head():
            assert trl_utils._ChunkedLogProbFunction is not trl_head
            raise RuntimeError
    assert trl_utils._ChunkedLogProbFunction is trl_head  # restored, also on error


def test_skip_fused_lm_head_runs_the_backbone_only_and_support_entropy_is_trls(llama_dir):
    """Inside the block the fused forward's log-probs and entropies read 0 (no head pass, no graph to the head);
    the support scorer's entropy over the same backbone output equals TRL's fused-head entropy."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_rollout_corr import support

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    gen = torch.Generator().manual_seed(0)
    B, P, T = 4, 5, 7
    ids = torch.randint(3, 40, (B, P + T), generator=gen)
    attn = torch.ones_like(ids)
    attn[:2, :2] = 0
    attn[2, P + 3:] = 0
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-T] = -100
    backbone, head = trl_compat.lm_head_input(model)
    with torch.no_grad(), trl_compat.score_trained_tokens_only():
        trl_out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        spec = support.sampler_from_generation_config({"do_sample": True, "top_p": 0.9, "temperature": 0.7})
        scorer = support.SupportScorer(spec, "recompute")
        with support.capture_module_outputs(backbone, lambda _a, _k, out: out.last_hidden_state) as hidden:
            with trl_compat.skip_fused_lm_head():
                skipped = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
        score = scorer.score(hidden[0], head.weight, head.bias, ids, attn, T, entropy_temperature=0.7)
    trained = attn[:, P:] == 1
    assert torch.all(skipped.log_probs == 0) and torch.all(skipped.entropy == 0)
    assert not skipped.log_probs.requires_grad
    torch.testing.assert_close(score.entropy[trained], trl_out.entropy[:, -T:][trained], atol=1e-5, rtol=0)
    assert torch.all(score.entropy[~trained] == 0)
    torch.testing.assert_close(hidden[0], model.model(input_ids=ids, attention_mask=attn).last_hidden_state)


def test_trl_coupling_vllm_client_cpu_weight_sync_hook():
    """What ``trl_compat.install_vllm_client_cpu_weight_sync`` relies on in TRL 1.16's ``VLLMClient`` /
    ``VLLMGeneration`` and ``trl vllm-serve`` (``engines/vllm_serve.server_command``)."""
    from trl.generation import vllm_client, vllm_generation
    from trl.scripts import vllm_serve

    cls = vllm_client.VLLMClient
    trl_methods = getattr(cls, "_trl_rollout_corr_trl_methods", None) or {
        name: getattr(cls, name) for name in trl_compat.VLLM_CLIENT_HOOKED}
    sig = {name: list(inspect.signature(fn).parameters) for name, fn in trl_methods.items()}
    assert sig == {"init_communicator": ["self", "device"], "close_communicator": ["self"],
                   "update_named_params": ["self", "metadata", "named_params"]}
    assert inspect.signature(trl_methods["init_communicator"]).parameters["device"].default == 0
    src_init = inspect.getsource(trl_methods["init_communicator"])
    # the path the hook replaces is the one TRL refuses: a non-CUDA device
    assert 'if device.type != "cuda":' in src_init and "raise NotImplementedError" in src_init
    assert 'self.get_server_info()["weight_transfer_config"]' in src_init and "self.communicator = " in src_init
    assert '"master_port": self.group_port' in src_init and "self.get_world_size() + 1" in src_init
    src_update = inspect.getsource(trl_methods["update_named_params"])
    for line in ("if not self._updating_weights:", "self._start_weight_update()", "self._finish_weight_update()",
                 'f"{self.base_url}/update_weights", json={"update_info": update_info}',
                 'update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}'):
        assert line in src_update, line
    assert "self.communicator = None" in inspect.getsource(trl_methods["close_communicator"])
    src_client_init = inspect.getsource(cls.__init__)
    assert "self.group_port = group_port" in src_client_init and "self._updating_weights = False" in src_client_init
    assert "self._updating_weights = True" in inspect.getsource(cls.weight_update)
    for name in ("_post", "_get", "_start_weight_update", "_finish_weight_update", "get_world_size",
                 "reset_prefix_cache"):
        assert callable(getattr(cls, name)), name
    # the trainer's calls
    gen = vllm_generation.VLLMGeneration
    assert "self.vllm_client.init_communicator(device=accelerator.device)" in inspect.getsource(gen._init_vllm)
    assert ("self.vllm_client.update_named_params(self._weight_metadata, self._iter_named_params())"
            in inspect.getsource(gen.sync_weights))
    # trl vllm-serve: the entry point and the backend the CPU command replaces
    src_build = inspect.getsource(vllm_serve.build_command)
    assert '"vllm.entrypoints.cli.main"' in src_build and 'json.dumps({"backend": "nccl"})' in src_build
    assert 'env["VLLM_SERVER_DEV_MODE"] = "1"' in inspect.getsource(vllm_serve.main)


def test_trl_coupling_fsdp2_generate_wrapper_pin():
    """``trl_compat.fsdp2_wrapped_method`` recognises torch's ``register_fsdp_forward_method`` wrapper by the code
    object of its nested ``wrapped_method`` (``functools.wraps`` hides its name), and transformers' Trainer sets that
    wrapper on ``model.generate`` under FSDP; accelerate keeps the sharding config where ``sharded_backend`` reads
    it."""
    import accelerate.state
    import transformers.trainer
    from torch.distributed.fsdp import register_fsdp_forward_method

    code = trl_compat.sharded._fsdp2_wrapper_code()
    assert code is not None and code.co_name == "wrapped_method"
    src = inspect.getsource(register_fsdp_forward_method)
    assert "@functools.wraps(orig_method)" in src and "def wrapped_method(self, *args, **kwargs)" in src
    assert 'register_fsdp_forward_method(self.model, "generate")' in inspect.getsource(transformers.trainer.Trainer)
    state_src = inspect.getsource(accelerate.state.AcceleratorState)
    assert "self.fsdp_plugin = fsdp_plugin" in state_src and "deepspeed_plugin" in state_src


@pytest.mark.unit
def test_trl_coupling_vllm_server_sampling():
    """``trl_compat.vllm_server_sampling`` copies the keyword arguments TRL 1.16's server-mode generation passes to
    ``VLLMClient.generate`` (the asynchronous vLLM engine sends them, one request per row). Pinned to TRL's source:
    the ``sampling_params`` dict of ``VLLMGeneration.generate``'s server branch, key for key, and where each local
    comes from; a key TRL adds, drops or fills differently fails here."""
    import ast
    import textwrap
    import types

    from trl.generation import vllm_generation

    src = textwrap.dedent(inspect.getsource(vllm_generation.VLLMGeneration.generate))
    dicts = [node for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Assign)
             and any(getattr(t, "id", None) == "sampling_params" for t in node.targets)
             and isinstance(node.value, ast.Dict)]
    assert len(dicts) == 1, "TRL's server branch no longer builds one sampling_params dict"
    trl_dict = {ast.literal_eval(k): ast.unparse(v) for k, v in zip(dicts[0].value.keys, dicts[0].value.values)}
    assert trl_dict == {
        "n": "num_generations", "repetition_penalty": "repetition_penalty", "temperature": "temperature",
        "top_p": "top_p", "top_k": "top_k", "min_p": "0.0 if min_p is None else min_p",
        "max_tokens": "max_completion_length", "logprobs": "self.logprobs",
        "structured_outputs_regex": "self.structured_outputs_regex", "generation_kwargs": "self.generation_kwargs"}
    for local in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length"):
        assert f"{local} = self.{local}\n" in src, local
    assert "self.vllm_client.generate(\n" in src and "prompts=ordered_set_of_prompt_ids, features=features, " \
        "**sampling_params" in src
    # ours: every key but n (one request per row, n=1), the same values, generation_kwargs copied
    g = types.SimpleNamespace(repetition_penalty=1.1, temperature=0.7, top_p=0.9, top_k=5, min_p=None,
                              max_completion_length=12, logprobs=0, structured_outputs_regex=None,
                              generation_kwargs={"seed": 3})
    ours = trl_compat.vllm_server_sampling(g)
    assert set(ours) == set(trl_dict) - {"n"}
    assert ours == {"repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
                    "max_tokens": 12, "logprobs": 0, "structured_outputs_regex": None,
                    "generation_kwargs": {"seed": 3}}
    assert ours["generation_kwargs"] is not g.generation_kwargs  # a copy: per-row seeds never leak into TRL's


@pytest.mark.unit
def test_cpu_weight_sync_leaves_no_thread_that_blocks_exit():
    """The gloo sync's background POST (``_init_cpu_communicator``, ``_cpu_update_named_params``): after a failed
    rendezvous or broadcast the request may never return. On a ``ThreadPoolExecutor`` worker that kept the
    interpreter alive at exit (Python joins those even after ``shutdown(wait=False)``); on a daemon thread
    (``engines.daemon_requests``) the run fails with the sync's message and the process exits at once."""
    import subprocess
    import sys
    import time

    code = '''
import threading, time
from trl_rollout_corr import trl_compat
from trl_rollout_corr.engines import vllm_weight_sync as ws

class Client:
    base_url, host, group_port, _updating_weights = "http://127.0.0.1:9", "127.0.0.1", 9, True
    def get_server_info(self): return {"weight_transfer_config": {"backend": ws.BACKEND}}
    def get_world_size(self): return 1
    def _post(self, *a, **k): time.sleep(3600)  # a server that never answers
    def _get(self, *a, **k): raise OSError("down")

def refuse(*a, **k): raise ConnectionError("peer gone")

ws.GlooChannel = ws.send_tensors = refuse
try:
    trl_compat.vllm_server._init_cpu_communicator(Client())
except RuntimeError as e:
    print("init:", str(e).split(" (")[0])
client = Client()
client.communicator = type("Channel", (), {"chunk_bytes": 1})()
try:
    trl_compat.vllm_server._cpu_update_named_params(client, [("w", "float32", [1])], iter([]))
except RuntimeError as e:
    print("update:", str(e).split(" (")[0])
print("threads:", sorted({t.name for t in threading.enumerate()}))
'''
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: a thread stuck in a request was joined at interpreter exit")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "init: weight-sync set-up failed: peer gone", "update: weight sync failed: peer gone",
        "threads: ['MainThread', 'trl-rollout-corr-sync']"]
    assert time.monotonic() - started < 30


def test_trl_coupling_checkpoint_state_pins(tmp_path):
    """``trl_compat.trainer_state``'s checkpoint assumptions (for ``checkpoint_state``) about transformers 5.x's
    Trainer (and TRL 1.16's override): the checkpoint of step N is ``<output_dir>/checkpoint-N``, written before the
    callbacks' ``on_save``; ``train`` resolves ``resume_from_checkpoint=True`` to
    ``get_last_checkpoint(args.output_dir)``; the model, optimizer and ``TrainerState`` are loaded before
    ``on_train_begin``."""
    import transformers
    from transformers import Trainer

    assert transformers.__version__.startswith("5."), transformers.__version__
    save = inspect.getsource(Trainer._save_checkpoint)
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in save
    assert "run_dir = self._get_output_dir(trial=trial)" in save
    assert "output_dir = os.path.join(run_dir, checkpoint_folder)" in save
    assert "if self.hp_search_backend is not None and trial is not None:" in inspect.getsource(Trainer._get_output_dir)
    assert "super()._save_checkpoint(model, trial)" in inspect.getsource(GRPOTrainer._save_checkpoint)
    step = inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert ("self._save_checkpoint(model, trial)\n            self.control = self.callback_handler.on_save("
            in step)
    train = inspect.getsource(Trainer.train)
    assert ("if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:\n"
            "            resume_from_checkpoint = get_last_checkpoint(args.output_dir)") in train
    assert "resume_from_checkpoint" in inspect.signature(GRPOTrainer.train).parameters
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert (loop.index("self._init_training_state(") < loop.index("self._prepare_for_training(")
            < loop.index("self.callback_handler.on_train_begin("))
    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in prepare
    args = collections.namedtuple("Args", "output_dir")("/x/out")
    assert str(trl_compat.checkpoint_folder(args, 7)) == "/x/out/checkpoint-7"
    assert trl_compat.resume_checkpoint(args, False) is None and trl_compat.resume_checkpoint(args, None) is None
    assert trl_compat.resume_checkpoint(args, "/y/checkpoint-3") == "/y/checkpoint-3"
    assert trl_compat.resume_checkpoint(args, True) is None  # no such folder: the Trainer refuses it itself
    for step in (3, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
    latest = trl_compat.resume_checkpoint(collections.namedtuple("Args", "output_dir")(str(tmp_path)), True)
    assert latest == str(tmp_path / "checkpoint-12")


def test_trl_coupling_checkpoint_push_pins():
    """``trl_compat.pushes_checkpoints``' assumptions (for ``checkpoint_state.save_before_push`` and
    ``RolloutCorrGRPOTrainer._push_from_checkpoint``) about transformers 5.x: ``_save_checkpoint`` calls
    ``_push_from_checkpoint(<checkpoint folder>)`` on every rank (no rank test around the call) after writing the
    folder's trainer state, before rotating old checkpoints and before the callbacks' ``on_save``; the push returns
    at once with ``hub_strategy="end"`` and on ranks other than the main one, and uploads the folder itself as
    ``last-checkpoint`` / under its own name."""
    from transformers import Trainer
    from transformers.trainer_utils import HubStrategy

    from trl_rollout_corr import RolloutCorrGRPOTrainer

    save = inspect.getsource(Trainer._save_checkpoint)
    call = "        if self.args.push_to_hub:\n            self._push_from_checkpoint(output_dir)\n"
    assert call in save
    assert (save.index("self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))") < save.index(call)
            < save.index("rotate_checkpoints("))
    push = inspect.getsource(Trainer._push_from_checkpoint)
    assert push.count("def _push_from_checkpoint(self, checkpoint_folder: str)") == 1
    early = "if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:\n            return"
    assert early in push
    assert "folder_path=checkpoint_folder," in push and '"last-checkpoint"' in push
    assert "_push_from_checkpoint" in RolloutCorrGRPOTrainer.__dict__  # the override the coupling serves
    assert "checkpoint_state.save_before_push(self, checkpoint_folder)" in inspect.getsource(
        RolloutCorrGRPOTrainer._push_from_checkpoint)
    args = collections.namedtuple("Args", "push_to_hub hub_strategy")
    assert [trl_compat.pushes_checkpoints(args(True, s)) for s in ("every_save", "checkpoint", "all_checkpoints")] \
        == [True, True, True]
    assert not trl_compat.pushes_checkpoints(args(True, "end"))
    assert not trl_compat.pushes_checkpoints(args(True, HubStrategy.END))
    assert not trl_compat.pushes_checkpoints(args(False, "checkpoint"))
