"""A tiny Qwen2 that really calls a tool through ``transformers.generate`` (no fake generate), built locally.

TRL's own tool and environment tests replace ``model.generate`` with a function that returns fixed token ids, so
they never exercise a rollout-correction subclass, whose behaviour log-probs come from the logits processing of
the real ``generate``. ``make_tool_model_dir`` instead trains a tiny random Qwen2 (a few hundred Adam steps, a few
seconds on one CPU thread) on two conversations per prompt:

* ``<tool_call>{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>``, then, after the
  tool's answer, ``Done<|im_end|>``;
* a direct answer ``7<|im_end|>``.

Sampled at temperature 1 it calls the tool in roughly half of the rollouts (so GRPO groups have reward variance),
with TRL parsing the call through the ``response_template`` of its Qwen3 chat format. The chat template is a
compact, prefix-preserving Qwen-style one (no tool schema in the system prompt) so that prompts stay ~30 tokens.
"""

from __future__ import annotations

import torch

from tiny_model import save_model_dir

TOOL_CALL = '<tool_call>{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}</tool_call>'
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
# multi-character pieces of the tool-call JSON, so that the call is ~12 tokens to memorise instead of ~60
PIECES = ['{"name": "', '", "arguments": {"a": ', ', "b": ', "}}", "multiply_tool"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

# Qwen-style turns; assistant tool calls as <tool_call>{json}</tool_call>; no tool schema in the prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{{- '<tool_call>' + (tool_call.function | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- message.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


class MultiplyEnvironment:
    """An ``environment_factory`` environment exposing the same tool; it owns the reward (1 after a tool call)."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs):
        self.calls = 0
        return None

    def multiply_tool(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls > 0)


def make_tool_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_template

    vocab = {tok: i for i, tok in enumerate(SPECIALS + PIECES + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in PIECES])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="?")
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = qwen3_template  # TRL's parser for this turn format
    return fast


def prompts(n: int = 8) -> list:
    return [[{"role": "user", "content": f"{a}+{b}="}] for a, b in zip(range(n), range(3, 3 + n))]


def tool_dataset(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts(n)})


def _conversations(tok) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per training conversation: the assistant tokens are trained, nothing else."""
    out = []
    for prompt in prompts():
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        tool_turn = "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
        for pieces in ([(head, 0), (TOOL_CALL + "<|im_end|>", 1), (tool_turn, 0), ("Done<|im_end|>", 1)],
                       [(head, 0), ("7<|im_end|>", 1)]):
            ids, mask = [], []
            for text, trained in pieces:
                piece = tok(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [trained] * len(piece)
            out.append((ids, mask))
    return out


def make_tool_model_dir(path: str, steps: int = 150, seed: int = 0) -> str:
    """Train and save the tool-calling tiny Qwen2 and its tokenizer to ``path``; returns ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_tool_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    data = _conversations(tok)
    width = max(len(ids) for ids, _ in data)
    input_ids = torch.full((len(data), width), tok.pad_token_id)
    labels = torch.full((len(data), width), -100)
    attention = torch.zeros((len(data), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(data):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return save_model_dir(model, tok, path)
