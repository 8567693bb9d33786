"""Documentation generated from the single sources in the code.

``python -m trl_rollout_corr.docgen --config-table`` prints the configuration table of ``docs/configuration.md``,
rendered from ``config.CORRECTION_FIELD_TABLE`` (the same table that defines the fields of
``RolloutCorrectionConfig`` and ``RolloutCorrectionArguments`` and their ``--help`` texts).
``--hook-table`` prints the hook table of ``docs/architecture.md``: for each hook of the protocol (``hooks.py``),
the features (``features.FEATURES``) that implement it, read from the classes (a feature lists a hook if and only if
it overrides it), so the table cannot drift. ``tests/test_docs.py`` checks that both pages hold them.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .config import markdown_table

# the hooks in TRL's call order, with the TRL method each runs in
_HOOKS = (
    ("generation", "around", "`_generate_and_score_completions` (whole call)"),
    ("plain_generate", "around", "`_generate_single_turn` (plain `transformers.generate`)"),
    ("after_plain_generate", "after", "`_generate_single_turn`"),
    ("after_generate", "after", "`_generate`"),
    ("forward", "around", "`_get_per_token_logps_and_entropies` (every log-prob forward)"),
    ("on_batch", "before", "`_generate_and_score_completions` (before the mode's `score`)"),
    ("after_score", "after", "`_generate_and_score_completions` (after the mode's `score`)"),
    ("before_loss", "before", "`_compute_loss` (before the mode's `loss`)"),
    ("after_loss", "after", "`_compute_loss` (after the mode's `loss`)"),
    ("on_log", "before", "`log` (before TRL's `log`)"),
    ("after_log", "after", "`log` (after TRL's `log`)"),
)


def hook_table() -> str:
    """The Markdown table of hooks x features, from the classes of ``features.FEATURES``."""
    from .features import FEATURES
    from .hooks import Feature

    lines = ["| hook | kind | runs in (TRL) | features, in call order |", "|---|---|---|---|"]
    for hook, kind, where in _HOOKS:
        implementers = [f.__name__ for f in FEATURES if getattr(f, hook) is not getattr(Feature, hook)]
        if kind == "after":
            implementers.reverse()
        lines.append(f"| `{hook}` | {kind} | {where} | {', '.join(implementers) or '-'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the requested document to stdout; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m trl_rollout_corr.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--config-table", action="store_true", help="docs/configuration.md's table (Markdown)")
    parser.add_argument("--hook-table", action="store_true", help="docs/architecture.md's hook table (Markdown)")
    args = parser.parse_args(argv)
    if not (args.config_table or args.hook_table):
        parser.error("nothing to print: pass --config-table or --hook-table")
    print(markdown_table() if args.config_table else hook_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
