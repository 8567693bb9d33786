"""MoE routes in the records (``routes_packed``, spec 9): one binary value per row, packed small ints (``records``).

Layout: the expert ids of every position of the row (its prompt tokens, then its completion tokens) x MoE layer x
top-k, C order; one byte per id (``uint8``, 255 = no route) when the model has at most 255 experts, else int16
little-endian (``int16le``, -1 = no route). So L*k bytes per token before zstd (4 for 2 layers x top-2, 384 for 48
layers x top-8). The step file's ``routes_packed`` field carries the layout (``{"encoding", "layers", "top_k"}``) in
its Arrow metadata (``ROUTES_FIELD_META``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

import torch

from .schema import RecordsError, _pa

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

ROUTES_FIELD_META = b"trl_rollout_corr.routes"  # the routes_packed field's layout: {"encoding", "layers", "top_k"}
_ROUTE_ENCODINGS = {"uint8": (torch.uint8, 255), "int16le": (torch.int16, -1)}  # encoding -> (dtype, no-route id)


def routes_encoding(num_experts: int) -> str:
    """``"uint8"`` (one byte per expert id, 255 = no route) for E <= 255 experts, else ``"int16le"`` (-1)."""
    return "uint8" if int(num_experts) <= 255 else "int16le"


def pack_routes(routes: torch.Tensor, keep: torch.Tensor, encoding: str):
    """The ``routes_packed`` Arrow array: row i = the bytes of ``routes[i][keep[i]]`` ((n_i, L, k), C order).

    Args:
        routes: (B, N, L, k) int expert ids, ``-1`` where a position has no route. keep: (B, N) bool, the row's
            positions (its prompt then completion tokens, in order). encoding: ``routes_encoding(E)``.
    """
    pa = _pa()
    dtype, none = _ROUTE_ENCODINGS[encoding]
    B, _, L, k = routes.shape
    kept = routes.detach().cpu()[keep.cpu()]
    data = torch.where(kept < 0, torch.full_like(kept, none), kept).to(dtype).contiguous().numpy().tobytes()
    per_row = keep.sum(dim=1).cpu().to(torch.int64) * L * k * dtype.itemsize
    offsets = torch.zeros(B + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(per_row, 0).to(torch.int32)
    return pa.Array.from_buffers(pa.binary(), B, [None, pa.py_buffer(offsets.numpy().tobytes()), pa.py_buffer(data)])


def routes_layout(table: "pa.Table") -> Optional[dict]:
    """The ``routes_packed`` layout ``{"encoding", "layers", "top_k"}`` of a step file's table, or None."""
    if "routes_packed" not in table.column_names:
        return None
    meta = table.schema.field("routes_packed").metadata or {}
    return json.loads(meta[ROUTES_FIELD_META]) if ROUTES_FIELD_META in meta else None


def unpack_routes(table: "pa.Table", layout: Optional[dict] = None) -> list[Optional[torch.Tensor]]:
    """The MoE routes of each row of ``table``: (len(prompt_ids) + len(completion_ids), L, k) int16 expert ids,
    ``-1`` where a position has no route (``routing.NO_ROUTE``); None for a row without routes.

    Raises:
        RecordsError: the table has routes but no layout (not written by this writer).
    """
    layout = layout or routes_layout(table)
    if layout is None:
        if "routes_packed" in table.column_names and table.column("routes_packed").null_count < table.num_rows:
            raise RecordsError("routes_packed has no layout metadata (trl_rollout_corr.routes); not written by this "
                               "writer. Read one step file at a time (read_step_file).")
        return [None] * table.num_rows
    dtype, none = _ROUTE_ENCODINGS[layout["encoding"]]
    L, k = int(layout["layers"]), int(layout["top_k"])
    out = []
    for packed in table.column("routes_packed").to_pylist():
        if packed is None:
            out.append(None)
            continue
        ids = torch.frombuffer(bytearray(packed), dtype=dtype).to(torch.int16).reshape(-1, L, k) if packed else \
            torch.zeros(0, L, k, dtype=torch.int16)
        out.append(torch.where(ids == none, torch.full_like(ids, -1), ids) if dtype == torch.uint8 else ids)
    return out
