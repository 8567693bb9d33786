"""More tiny local models for the TRL feature tests (no Hub access): a Mixtral-style MoE policy (router aux loss)
and a sequence-classification reward model, both with the char-level tokenizer of ``tiny_model``."""

from __future__ import annotations

import torch

from tiny_model import make_tokenizer, save_model_dir


def _save(model, path: str) -> str:
    return save_model_dir(model, make_tokenizer(), path)


def _common(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                tie_word_embeddings=False)


def make_tiny_moe_dir(path: str, seed: int = 2) -> str:
    """A 2-layer Mixtral with 4 experts (top-2) that returns its router logits (TRL's aux-loss path)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = MixtralConfig(head_dim=32, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.01, **_common(tok))
    model = MixtralForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # structured samples, as tiny_model does
    return _save(model, path)


def make_tiny_reward_model_dir(path: str, seed: int = 3) -> str:
    """A 2-layer Llama sequence classifier with one label (TRL loads it with num_labels=1)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = make_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(LlamaConfig(head_dim=32, num_labels=1, **_common(tok))).float()
    return _save(model, path)
