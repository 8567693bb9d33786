"""What ``async_wallclock.py``'s cells must pass before its report counts them (issue 47); pure functions.

* ``lag_check``: the policy-lag schedule a cell logged (``trainer.state.log_history``'s per-step rows): at logged
  step t (1-based, one generation per optimizer step) ``rollout_corr/policy_lag_max`` equals min(t - 1, d) for an
  asynchronous setting of depth d and 0 for a synchronous one, over exactly the design's steps (schedule only, as
  ``async_lag_grid.async_lag_check``'s schedule part; no k3 bound: the engine here is float32 like the trainer);
* ``select_cells``: the committed cells the report uses: those of the requested design (``DESIGN_CHECK_KEYS``),
  of the expected cells (seeds beyond ``--seeds`` and unknown settings ignored), that passed the lag check and, with
  ``refuse_load``, ran without foreign load above ``max_foreign_cores``; every other one is listed with the reason;
* ``code_revisions``: the code revisions the kept cells ran at, with their cells.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_accounting as cpu  # noqa: E402  (benchmarks/, next to this file)

LAG_KEY = "rollout_corr/policy_lag_max"
DESIGN_CHECK_KEYS = ("model", "steps", "prompts", "lr", "preset", "engine", "check_every", "check_dense_every",
                     "check_dense_until", "check_size", "eval_size", "eval_max_tokens", "server_spin_s")
# design keys added after cells were committed, with the value those cells ran at: the vLLM server's queue
# busy-wait was vLLM's default (1 s) until 2026-12-07 16:00 UTC (engines/vllm_spin.py)
LEGACY_DESIGN = {"server_spin_s": 1.0}


def recorded_design(design: dict) -> dict:
    """A committed cell's ``design`` with ``LEGACY_DESIGN``'s values for the keys it predates."""
    return {**LEGACY_DESIGN, **design}


def lag_check(logs: list[dict], depth: int, steps: int) -> list[str]:
    """The schedule violations of a finished cell (empty when it passes).

    Args:
        logs: TRL's per-step log rows (``log_history`` rows with a ``loss``), in step order.
        depth: the setting's ``rollout_async_depth`` (0: synchronous).
        steps: the design's optimizer steps (a cut or padded log fails)."""
    problems = [] if len(logs) == steps else [f"{len(logs)} logged steps, expected {steps}"]
    for t, row in enumerate(logs, start=1):
        want = min(t - 1, depth)
        got = row.get(LAG_KEY)
        if got != want:
            problems.append(f"step {row.get('step', t)}: {LAG_KEY} {got}, expected {want}")
    return problems


def select_cells(cells: dict[str, dict], expected: list[str], design: dict, max_foreign_cores: float = 0.10,
                 refuse_load: bool = False) -> tuple[dict[str, dict], list[str], list[str]]:
    """(kept cells, left-out lines ``name: reason``, load-flag lines ``name: reason`` for kept cells that ran beside
    other load). Left out: a cell not in ``expected`` (seeds beyond ``--seeds``), one whose recorded ``design``
    differs from ``design`` on a ``DESIGN_CHECK_KEYS`` key that ``design`` has, one whose ``lag_check`` failed (or
    was not recorded), and with ``refuse_load`` one that ``cpu_accounting.load_flag`` flags."""
    kept, left_out, flagged = {}, [], []
    for name, cell in cells.items():
        theirs = recorded_design(cell.get("design", {}))
        diff = [k for k in DESIGN_CHECK_KEYS if k in design and theirs.get(k) != design[k]]
        flag = cpu.load_flag(cell.get("cpu_use"), max_foreign_cores)
        if name not in expected:
            left_out.append(f"{name}: not among the requested cells (--seeds)")
        elif diff:
            left_out.append(f"{name}: another design ({', '.join(f'{k} {theirs.get(k)!r}' for k in diff)})")
        elif cell.get("lag_check") is None or cell["lag_check"]:
            left_out.append(f"{name}: lag check {cell.get('lag_check') or 'not recorded'}")
        elif flag and refuse_load:
            left_out.append(f"{name}: {flag}")
        else:
            kept[name] = cell
            if flag:
                flagged.append(f"{name}: {flag}")
    return kept, left_out, flagged


def code_revisions(cells: dict[str, dict]) -> dict[str, list[str]]:
    """{code revision: the cells that ran at it}, revisions sorted; ``"?"`` where a cell did not record one."""
    out: dict[str, list[str]] = {}
    for name, cell in cells.items():
        out.setdefault(cell.get("code", "?"), []).append(name)
    return dict(sorted(out.items()))
