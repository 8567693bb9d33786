"""Import a repository script that is not a package module (``benchmarks/*.py``, ``recipes/*.py``) by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """Execute the script at ``ROOT / relative`` as a module called ``name`` (default: the file's stem).

    The module is entered in ``sys.modules`` under ``name`` before it runs, because dataclasses look their module
    up there; give each test file its own ``name`` where two files load the same script with different state.

    Raises:
        FileNotFoundError: ``relative`` names no file in the repository.
    """
    path = ROOT / relative
    if not path.is_file():
        raise FileNotFoundError(f"no script {path}: the path is relative to the repository root ({ROOT})")
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
