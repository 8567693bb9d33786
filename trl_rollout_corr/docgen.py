"""Documentation generated from the single sources in the code.

``python -m trl_rollout_corr.docgen --config-table`` prints the README's configuration table, rendered from
``config.CORRECTION_FIELD_TABLE`` (the same table that defines the fields of ``RolloutCorrectionConfig`` and
``RolloutCorrectionArguments`` and their ``--help`` texts).
"""

from __future__ import annotations

import argparse
from typing import Optional

from .config import markdown_table


def main(argv: Optional[list[str]] = None) -> int:
    """Print the requested document to stdout; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m trl_rollout_corr.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--config-table", action="store_true", help="the README's configuration table (Markdown)")
    args = parser.parse_args(argv)
    if not args.config_table:
        parser.error("nothing to print: pass --config-table")
    print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
