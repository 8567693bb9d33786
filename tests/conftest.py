"""Shared pytest configuration.

Markers registered here: ``unit`` marks the fast component tests (pure math, config, losses, TRL formulas, the
accumulator, the generate engine on a tiny model; no training run), so ``pytest -m unit`` selects them.
"""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "unit: fast component tests (no training run, seconds in all); `pytest -m unit`"
    )
