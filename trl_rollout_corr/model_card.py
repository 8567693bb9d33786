"""The model card section ``RolloutCorrGRPOTrainer`` adds to every card it writes.

TRL's trainers write their model card in ``create_model_card`` (``trl.trainer.base_trainer._BaseTrainer``), which
``Trainer.push_to_hub``, TRL's ``_save_checkpoint`` and ``save_model`` with ``push_to_hub=True`` all call, each
time regenerating ``README.md`` in ``args.output_dir`` from TRL's template. The trainer overrides that one method to
call TRL's and then ``write_section`` here, so every card it writes, locally and on the Hub, records:

* the effective correction config (``correction_record``: the ``RolloutCorrectionConfig`` fields after preset
  expansion, plus the trainer-level switches);
* what produced the behaviour log-probs mu (``rollout_engine_record``);
* any tables the caller adds to ``trainer.model_card_sections`` (``{title: {key: value}}``, e.g. the task and the
  held-out accuracy the recipe measures).

The section sits between two HTML comments, so writing it again replaces it instead of appending a second copy
(PEFT's ``save_pretrained`` updates an existing card in place, keeping it). ``complete_card`` also mends the two
places where TRL's template (``trl/templates/lm_model_card.md``) prints ``None`` for a model trained from local
weights, which TRL gives no base model id and, before a push, no Hub id. Nothing here imports TRL.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional

BEGIN = "<!-- trl-rollout-corr: begin -->"
END = "<!-- trl-rollout-corr: end -->"
TAGS = ("trl-rollout-corr", "rollout-correction")
TRAINER_FIELDS = ("rollout_corr_preset", "rs_keep_rejected_in_baseline", "vllm_importance_sampling_correction")


def correction_record(args: Any) -> dict[str, Any]:
    """The effective correction fields of a ``RolloutCorrGRPOConfig`` (after preset expansion).

    Args:
        args: a ``RolloutCorrGRPOConfig`` (it carries every ``RolloutCorrectionConfig`` field under the same name).

    Returns:
        ``{field: value}`` for the ``RolloutCorrectionConfig`` fields, then ``TRAINER_FIELDS`` (None where ``args``
        lacks them).

    Raises:
        AttributeError: ``args`` lacks a ``RolloutCorrectionConfig`` field (it is not a ``RolloutCorrGRPOConfig``).
    """
    from .config import RolloutCorrectionConfig

    record = {f.name: getattr(args, f.name) for f in fields(RolloutCorrectionConfig) if f.init}
    record.update({name: getattr(args, name, None) for name in TRAINER_FIELDS})
    return record


def rollout_engine_record(trainer: Any) -> dict[str, Any]:
    """What produced mu in this trainer: the one description of the rollout engine.

    The model card (``write_section``), the rollout records' ``run.json`` (``features.rollout_records``) and the
    recipe's run summary (``results.json``, ``log.jsonl``, ``summary.md``) all call this function, so the three
    name the engine with the same keys and values. A ``rollout_func`` with a ``describe()`` method
    (``engines.vllm_cpu_rollout.VLLMCPURollout``: ``vllm_cpu``) describes itself; another ``rollout_func`` is named
    by its ``__qualname__``; otherwise TRL's vLLM path (``use_vllm``: the backend's ``describe()``, see
    ``trl_compat.colocate_generation_class``, ``trl_vllm_colocate`` / ``trl_vllm_server``, processed log-probs),
    TRL's continuous batching (``continuous_batching_record``) or the plain ``transformers.generate`` path: its
    transformers version, the dtype it samples in (``rollout_generate_dtype`` when set, else the weights' dtype;
    `` (bf16 autocast)`` appended with ``bf16=True``) and the processed log-probs.

    Args:
        trainer: a ``GRPOTrainer`` (reads ``rollout_func``, ``use_vllm``, ``vllm_generation``,
            ``use_transformers_continuous_batching``, ``args``, ``model``).

    Returns:
        ``{"rollout_engine": ..., ...}``, string values (plus whatever an engine's ``describe()`` returns).
    """
    rollout_func = getattr(trainer, "rollout_func", None)
    if rollout_func is not None:
        describe = getattr(rollout_func, "describe", None)
        if callable(describe):
            return dict(describe())
        name = getattr(rollout_func, "__qualname__", type(rollout_func).__qualname__)
        return {"rollout_engine": f"rollout_func {name}", "rollout_logprobs_mode": "as returned by the rollout_func"}
    args = trainer.args
    if getattr(trainer, "use_vllm", False):
        describe = getattr(getattr(trainer, "vllm_generation", None), "describe", None)
        if callable(describe):  # trl_compat.colocate_generation_class()
            return dict(describe())
        return {"rollout_engine": f"trl_vllm_{args.vllm_mode}", "rollout_logprobs_mode": "processed_logprobs"}
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return continuous_batching_record(trainer)
    import transformers

    dtype = args.rollout_generate_dtype or str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    return {"rollout_engine": "transformers.generate", "rollout_engine_version": transformers.__version__,
            "rollout_dtype": f"{dtype}{' (bf16 autocast)' if args.bf16 else ''}",
            "rollout_logprobs_mode": "processed (log_softmax of the final processed scores)"}


def continuous_batching_record(trainer: Any) -> dict[str, Any]:
    """What TRL's continuous-batching path (``use_transformers_continuous_batching``, ``generate_batch``) ran: the
    training dtype TRL casts the policy to for it (bf16 / fp16 when set, else the weights' own), no log-probs.
    ``rollout_generate_dtype`` is refused with it (``RolloutCorrGRPOConfig``)."""
    args = trainer.args
    dtype = "bfloat16" if args.bf16 else "float16" if getattr(args, "fp16", False) else str(
        next(trainer.model.parameters()).dtype).split(".")[-1]
    return {"rollout_engine": "transformers continuous batching (generate_batch)", "rollout_dtype": dtype,
            "rollout_logprobs_mode": "none (continuous batching returns no log-probs)"}


def render_section(correction: Mapping[str, Any], engine: Mapping[str, Any],
                   tables: Optional[Mapping[str, Mapping[str, Any]]] = None) -> str:
    """The card section as Markdown: a table for the correction, one for the engine, one per entry of ``tables``.

    Args:
        correction: from ``correction_record``.
        engine: from ``rollout_engine_record`` (or any ``{key: value}``).
        tables: ``{title: {key: value}}``, rendered in order after the two above.

    Returns:
        Markdown wrapped in ``BEGIN`` / ``END`` markers, ending with a newline.
    """
    lines = [BEGIN, "", "## Rollout correction (trl-rollout-corr)", "",
             "Trained with `RolloutCorrGRPOTrainer`: TRL's GRPO corrected for the mismatch between the rollout engine "
             "(mu) and the trainer (pi).", ""]
    for title, rows in (("correction field", correction), ("rollout engine", engine), *(tables or {}).items()):
        lines += [f"| {title} | value |", "|---|---|", *(f"| `{k}` | `{v}` |" for k, v in rows.items()), ""]
    return "\n".join([*lines, END]) + "\n"


# What TRL 1.16's template renders with base_model=None / hub_model_id=None (pinned in tests/unit/test_model_card.py).
TRL_NO_BASE_MODEL = "[None](https://huggingface.co/None)"
TRL_NO_HUB_ID = 'model="None"'


def complete_card(readme: str | Path, trainer: Any) -> Path:
    """Add the section to the card TRL just wrote at ``readme`` and mend TRL's ``None`` placeholders.

    Args:
        readme: ``args.output_dir/README.md``, as written by TRL's ``create_model_card``.
        trainer: the ``RolloutCorrGRPOTrainer`` (reads ``args``, ``model``, ``hub_model_id``,
            ``model_card_sections`` and what ``rollout_engine_record`` reads).

    Returns:
        The path written.
    """
    path = Path(readme)
    text = path.read_text() if path.is_file() else ""
    source = str(getattr(trainer.model.config, "_name_or_path", "") or "")
    local = f"`{Path(source).name or source}` (local weights: `{source}`)" if source else "local weights"
    hub_id = getattr(trainer, "hub_model_id", None) or str(Path(trainer.args.output_dir).resolve())
    text = text.replace(TRL_NO_BASE_MODEL, local).replace(TRL_NO_HUB_ID, f'model="{hub_id}"')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    section = render_section(correction_record(trainer.args), rollout_engine_record(trainer),
                             getattr(trainer, "model_card_sections", None))
    return write_section(path, section)


def write_section(readme: str | Path, section: str) -> Path:
    """Put ``section`` (from ``render_section``) into the card at ``readme``, replacing a previous one.

    Args:
        readme: the card's path (``README.md``); created if missing.
        section: Markdown from ``render_section`` (with its markers).

    Returns:
        The path written.
    """
    path = Path(readme)
    text = path.read_text() if path.is_file() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
