"""CPU seconds of a benchmark cell and of everything else on the machine, from ``/proc`` (Linux), to flag a cell
that ran beside other load (``async_wallclock.py``, issue 47).

A snapshot (``snapshot``) at training start and one at training end give, over the cell's wall seconds:

* ``cpu_s`` per label and their sum ``ours_cpu_s``: user + system CPU seconds of OUR processes: every process in
  one of ``groups`` (process group ids: ``trainer``, the worker's own group when it leads one, and ``server``, the
  vLLM server's, which ``VLLMServer`` starts in its own session) and the calling process itself (``trainer``).
  Each process counts ``utime + stime`` and its reaped children's ``cutime + cstime``
  (``/proc/<pid>/stat`` fields 14-17, clock ticks). A process of ours that exits between the snapshots and is not
  reaped by another of ours is lost (its seconds then count as foreign: conservative for the flag);
* ``busy_cpu_s``: the whole machine's busy seconds (``/proc/stat``'s ``cpu`` line: user + nice + system + irq +
  softirq + steal; idle and iowait are not busy; guest time is already inside user);
* ``foreign_cpu_s`` = busy - ours (clamped at 0: tick rounding), and ``foreign_cores`` = foreign / wall: the average
  number of cores other processes kept busy (0.10 = 10 % of a core);
* ``loadavg``: ``/proc/loadavg``'s 1, 5 and 15-minute averages at each snapshot.

Pure parsers (``parse_pid_stat``, ``parse_proc_stat``, ``parse_loadavg``) and arithmetic (``cpu_usage``), tested on
hand-written ``/proc`` text; ``snapshot`` is the only function reading ``/proc``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def parse_pid_stat(text: str) -> dict:
    """One ``/proc/<pid>/stat`` line -> ``{"pid", "ppid", "pgrp", "ticks"}``; ``ticks`` = utime + stime + cutime +
    cstime (clock ticks). The command name (field 2) may hold spaces and parentheses: the fields are read after its
    LAST ``)``.

    Raises:
        ValueError: a line without ``(comm)`` or with fewer than 17 fields."""
    head, sep, rest = text.strip().rpartition(")")
    fields = rest.split()
    if not sep or "(" not in head or len(fields) < 15:
        raise ValueError(f"not a /proc/<pid>/stat line (pid (comm) state ppid pgrp ... cstime): {text[:80]!r}")
    # fields[0] is field 3 (state): field k is fields[k - 3]
    return {"pid": int(head.split("(", 1)[0]), "ppid": int(fields[1]), "pgrp": int(fields[2]),
            "ticks": sum(int(fields[k - 3]) for k in (14, 15, 16, 17))}


def parse_proc_stat(text: str) -> int:
    """``/proc/stat`` -> the machine's busy clock ticks since boot, from its aggregate ``cpu`` line: user + nice +
    system + irq + softirq + steal (idle and iowait left out; guest and guest_nice are already counted in user and
    nice).

    Raises:
        ValueError: no ``cpu `` line or fewer than 8 numbers on it."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            if len(parts) < 9:
                raise ValueError(f"/proc/stat's cpu line has {len(parts) - 1} numbers, expected >= 8: {line!r}")
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[1:9])
            return user + nice + system + irq + softirq + steal
    raise ValueError("no aggregate 'cpu ' line in /proc/stat text")


def parse_loadavg(text: str) -> list[float]:
    """``/proc/loadavg`` -> its 1, 5 and 15-minute load averages.

    Raises:
        ValueError: fewer than three numbers."""
    parts = text.split()
    if len(parts) < 3:
        raise ValueError(f"not /proc/loadavg text: {text!r}")
    return [float(x) for x in parts[:3]]


def ours_ticks(stats: list[dict], groups: dict[str, int], own_pid: int) -> dict[str, int]:
    """{label: sum of ``ticks`` over the parsed stats whose ``pgrp`` is ``groups[label]``}; the process ``own_pid``
    counts under ``"trainer"`` when no group holds it. A pid counts once (the first label that holds it)."""
    out, seen = {label: 0 for label in groups}, set()
    out.setdefault("trainer", 0)
    for label, pgrp in groups.items():
        for s in stats:
            if s["pgrp"] == pgrp and s["pid"] not in seen:
                out[label] += s["ticks"]
                seen.add(s["pid"])
    out["trainer"] += sum(s["ticks"] for s in stats if s["pid"] == own_pid and s["pid"] not in seen)
    return out


def snapshot(groups: dict[str, int], proc: Path = Path("/proc")) -> dict:
    """The machine's and our CPU ticks now: ``{"t": monotonic seconds, "ours_ticks": {label: ticks}, "busy_ticks",
    "loadavg", "hz"}``. ``groups``: {label: process group id} of ours (see the module docstring; -1 for none);
    processes that vanish while being read are skipped."""
    stats = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stats.append(parse_pid_stat((entry / "stat").read_text()))
            except (OSError, ValueError):
                continue
    return {"t": time.monotonic(), "ours_ticks": ours_ticks(stats, groups, os.getpid()),
            "busy_ticks": parse_proc_stat((proc / "stat").read_text()),
            "loadavg": parse_loadavg((proc / "loadavg").read_text()), "hz": os.sysconf("SC_CLK_TCK")}


def cpu_usage(start: dict, end: dict) -> dict:
    """Two ``snapshot`` dicts -> ``{"wall_s", "cpu_s": {label: seconds}, "ours_cpu_s", "busy_cpu_s",
    "foreign_cpu_s", "foreign_cores", "loadavg_start", "loadavg_end"}`` (seconds; ``foreign_cores`` = foreign
    seconds / wall seconds).

    Raises:
        ValueError: ``end`` not after ``start``, or their clock-tick rates differ."""
    wall = end["t"] - start["t"]
    if wall <= 0 or start["hz"] != end["hz"]:
        raise ValueError(f"cpu_usage needs a later end snapshot at the same tick rate: {start['t']}->{end['t']} s, "
                         f"{start['hz']}/{end['hz']} Hz")
    hz = start["hz"]
    per = {k: round((end["ours_ticks"][k] - start["ours_ticks"].get(k, 0)) / hz, 2) for k in end["ours_ticks"]}
    ours = sum(per.values())
    busy = (end["busy_ticks"] - start["busy_ticks"]) / hz
    foreign = max(0.0, busy - ours)
    return {"wall_s": round(wall, 3), "cpu_s": per, "ours_cpu_s": round(ours, 2), "busy_cpu_s": round(busy, 2),
            "foreign_cpu_s": round(foreign, 2), "foreign_cores": round(foreign / wall, 4),
            "loadavg_start": start["loadavg"], "loadavg_end": end["loadavg"]}


def load_flag(usage: dict | None, max_foreign_cores: float) -> str | None:
    """Why a cell's ``cpu_usage`` says it ran beside other load (``foreign_cores`` above ``max_foreign_cores``), or
    None when it did not; ``"not recorded"`` when ``usage`` is missing."""
    if not usage:
        return "CPU use not recorded"
    if usage["foreign_cores"] > max_foreign_cores:
        return (f"other processes used {usage['foreign_cores']:.2f} cores on average (> {max_foreign_cores:g}; load "
                f"{usage['loadavg_start'][0]:g} -> {usage['loadavg_end'][0]:g})")
    return None
