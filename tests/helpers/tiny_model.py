"""Tiny random causal LMs and a char-level tokenizer, built locally (no Hub access, no weights downloaded).

``make_tiny_model_dir(path, arch)`` saves a randomly initialised Llama or Qwen2 (hidden 64, 2 heads -> head_dim 32,
2 layers, vocab ~40) and a matching char-level ``PreTrainedTokenizerFast`` to ``path`` and returns it, so a
``GRPOTrainer`` can load both from a local path (needed for ``beta > 0``: TRL rebuilds the reference model from
the policy's ``name_or_path``). ``arch`` may also name a mixture-of-experts family (``MOE_ARCHS``: Qwen3-MoE,
OLMoE, Mixtral, Qwen2-MoE; 8 experts (Mixtral 4), top-2, every layer MoE except Qwen2-MoE's layer 0), for the
routing-replay tests.
"""

from __future__ import annotations

import os

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +=?")
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="?"
    )
    return fast


MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe")


def _moe_model(arch: str, common: dict, router_scale: float):
    import transformers as tf

    moe = dict(num_experts=8, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(head_dim=32, moe_intermediate_size=32, norm_topk_prob=True,
                                                         **moe, **common))
    elif arch == "olmoe":  # OLMoE's default: no renormalisation of the top-k weights
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**{**common, "intermediate_size": 32}, **moe))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                                       **{**common, "intermediate_size": 32}))
    elif arch == "qwen2_moe":  # a shared expert, and a dense first layer (mixed model: MoE layer indices [1])
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                         mlp_only_layers=[0], **moe, **common))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    # std-0.02 routers give near-uniform router probabilities (every top-k a near tie); scaling them gives
    # routing with some structure, as a trained router has
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(router_scale)
    return model


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = None, router_scale: float = 10.0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = make_tokenizer()
    vocab_size = vocab_size or len(tok)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=32, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch in MOE_ARCHS:
        model = _moe_model(arch, common, router_scale)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    # Random init with std 0.02 gives near-uniform next-token distributions; scale the LM head so sampled
    # completions have some structure (and log-probs are not all ~ -log V).
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.float(), tok


# A minimal chat template (each message's content on its own line, then "=" for the answer), for conversational
# prompts such as the recipe's reasoning-gym chats; characters outside CHARS tokenise to "?".
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] | lower }}\n{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def make_tiny_model_dir(path: str, arch: str = "llama", seed: int = 0, chat_template: bool = False) -> str:
    """Save ``make_tiny_model(arch, seed)`` and its tokenizer (with ``CHAT_TEMPLATE`` if asked) to ``path``."""
    model, tok = make_tiny_model(arch, seed)
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return save_model_dir(model, tok, path, generation_ids=False)


def save_model_dir(model, tok, path: str, generation_ids: bool = True) -> str:
    """Save ``model`` and ``tok`` to ``path`` (created); with ``generation_ids`` the generation config's pad/eos ids
    are set from ``tok`` first."""
    if generation_ids and getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def prompt_dataset(n: int = 8):
    from datasets import Dataset

    prompts = [f"{a}+{b}=" for a, b in zip(range(n), range(3, 3 + n))]
    return Dataset.from_dict({"prompt": prompts})


def reward_len(completions, **kwargs):
    """Reward: number of 'a' characters minus a small length penalty (deterministic, varied across samples)."""
    return [float(c.count("a")) - 0.05 * len(c) + 0.1 * sum(ch.isdigit() for ch in c) for c in completions]
