"""Documentation generated from the single sources in the code.

``python -m trl_rollout_corr.docgen --config-table`` prints the configuration table of
``docs/reference/configuration.md``,
rendered from ``config.CORRECTION_FIELD_TABLE`` (the same table that defines the fields of
``RolloutCorrectionConfig`` and ``RolloutCorrectionArguments`` and their ``--help`` texts).
``--hook-table`` prints the hook list of ``docs/explanation/architecture.md``: for each hook of the protocol
(``hooks.py``),
the features (``features.FEATURES``) that implement it, read from the classes (a feature lists a hook if and only if
it overrides it), so the table cannot drift. ``--batch-key-table`` and ``--role-table`` print the batch keys and
the forward roles of ``docs/explanation/architecture.md`` from their one declaration (``hooks.BATCH_KEYS``,
``hooks.FORWARD_ROLES``). ``--cli`` prints ``docs/reference/cli.md``'s body: the ``--help`` of ``trl-rollout-corr``
and of each sub-command, from ``cli.build_parser`` (at 100 columns, whatever the terminal). ``tests/unit/test_docs.py``
checks that the pages hold them all.

Whole pages (``docgen_pages.GENERATED_PAGES``: the trainer fields, the presets, the metrics, the recorded trainer
fields of the rollout records): ``--write`` writes every one of them into the repository (run from its root),
``--page PATH`` prints one; ``tests/unit/test_docs.py`` fails when a committed page differs from what ``--write``
writes.
"""

from __future__ import annotations

import argparse
import functools
import textwrap
from pathlib import Path
from typing import Optional

from .config import markdown_table
from .docgen_pages import GENERATED_PAGES

# the hooks in TRL's call order, with the TRL method each runs in
_HOOKS = (
    ("check_config", "before", "`RolloutCorrGRPOConfig.__post_init__` (construction; each feature, then the mode)"),
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


def _item(text: str) -> str:
    """One Markdown list item, wrapped at 120 columns (continuation lines indented by two)."""
    return "\n".join(textwrap.wrap(text, 120, initial_indent="* ", subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False))


def hook_table() -> str:
    """The hooks x features list (one item per hook: kind, where it runs in TRL, the implementing features), from the
    classes of ``features.FEATURES``."""
    from .features import FEATURES
    from .hooks import Feature

    lines = []
    for hook, kind, where in _HOOKS:
        implementers = [f.__name__ for f in FEATURES if getattr(f, hook) is not getattr(Feature, hook)]
        if kind == "after":
            implementers.reverse()
        lines.append(_item(f"`{hook}` ({kind}; runs in {where}): {', '.join(implementers) or '-'}"))
    return "\n".join(lines)


def batch_key_table() -> str:
    """The batch keys as a Markdown list, from ``hooks.BATCH_KEYS`` (declaration order)."""
    from .hooks import BATCH_KEYS

    return "\n".join(_item(f"`{key.name}`, {key.shape}: written by {', '.join(key.writers)}; read by {key.readers}; "
                           f"when: {key.note or '-'}") for key in BATCH_KEYS)


def role_table() -> str:
    """The forward roles as a Markdown list, from ``hooks.FORWARD_ROLES``."""
    from .hooks import FORWARD_ROLES

    return "\n".join(_item(f"`{r.name}`: started by {r.started_by}; grad: {r.grad}; routing replay: {r.replay}; "
                           f"support scoring: {r.support}; counts as pi_theta: {r.pi_theta}") for r in FORWARD_ROLES)


def cli_reference() -> str:
    """The ``--help`` text of ``trl-rollout-corr`` and of its ``analyze`` and ``probe`` sub-commands, as Markdown
    (one fenced block each), rendered at a fixed width so the page does not depend on the terminal."""
    from .cli import build_parser

    def fixed_width(parser: argparse.ArgumentParser) -> str:
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=100)
        return parser.format_help().rstrip()

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [f"## `trl-rollout-corr`\n\n```\n{fixed_width(parser)}\n```"]
    for name in ("analyze", "probe"):
        parts.append(f"## `trl-rollout-corr {name}`\n\n```\n{fixed_width(subs.choices[name])}\n```")
    return "\n\n".join(parts)


_TABLES = {"config_table": lambda: markdown_table(), "hook_table": hook_table, "batch_key_table": batch_key_table,
           "role_table": role_table, "cli": cli_reference}


def main(argv: Optional[list[str]] = None) -> int:
    """Print the requested document to stdout; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m trl_rollout_corr.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--config-table", action="store_true", help="the configuration table (Markdown)")
    parser.add_argument("--hook-table", action="store_true", help="the architecture page's hook table (Markdown)")
    parser.add_argument("--batch-key-table", action="store_true", help="the architecture page's batch keys (Markdown)")
    parser.add_argument("--role-table", action="store_true", help="the architecture page's forward roles (Markdown)")
    parser.add_argument("--cli", action="store_true", help="docs/reference/cli.md's body: every --help (Markdown)")
    parser.add_argument("--page", choices=tuple(GENERATED_PAGES), help="print one generated page (Markdown)")
    parser.add_argument("--write", action="store_true",
                        help="write every generated page (docgen_pages.GENERATED_PAGES) under the current directory, "
                        "the repository root")
    args = parser.parse_args(argv)
    if args.write:
        root = Path.cwd()
        if not (root / "trl_rollout_corr" / "docgen.py").is_file():
            parser.error(f"--write writes into the repository: run it from the repository root, not {root}")
        for rel, render in GENERATED_PAGES.items():
            (root / rel).write_text(render())
            print(f"wrote {rel}")
        return 0
    if args.page:
        print(GENERATED_PAGES[args.page](), end="")
        return 0
    chosen = [name for name in _TABLES if getattr(args, name)]
    if not chosen:
        parser.error("nothing to print: pass --config-table, --hook-table, --batch-key-table, --role-table, --cli, "
                     "--page PATH or --write")
    print("\n\n".join(_TABLES[name]() for name in chosen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
