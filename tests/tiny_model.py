"""Tiny random causal LMs and a char-level tokenizer, built locally (no Hub access, no weights downloaded).

``make_tiny_model_dir(path, arch)`` saves a randomly initialised Llama or Qwen2 (hidden 64, 2 heads -> head_dim 32,
2 layers, vocab ~40) and a matching char-level ``PreTrainedTokenizerFast`` to ``path`` and returns it, so a
``GRPOTrainer`` can load both from a local path (needed for ``beta > 0``: TRL rebuilds the reference model from
the policy's ``name_or_path``).
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


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = None):
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
