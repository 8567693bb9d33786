"""Loads the spec's test vectors (copied from the project spec into tests/data so a clone is self-contained)."""

import json
from pathlib import Path

import torch

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "data" / "testvectors.json").read_text())


def tensor(name: str, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(VECTORS["inputs"][name], dtype=dtype)
