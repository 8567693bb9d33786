"""Ranks simulated by threads in one process: ``accumulator.Reducers`` whose collectives really exchange tensors
between the threads (a barrier, then every rank combines all ranks' tensors in rank order, so every rank gets the
same bits). Collectives run in the order each rank calls them, as torch.distributed's do: a rank that skips one
hangs the others, which the barrier's timeout turns into an error."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from trl_rollout_corr.accumulator import Reducers


def run_ranks(world: int, fn: Callable[[int, Reducers], Any], timeout: float = 30.0) -> list:
    """``fn(rank, reducers)`` on ``world`` threads; their results in rank order (re-raises a thread's error).

    Raises:
        threading.BrokenBarrierError: ranks that did not run the same collectives (a hang on real ranks).
    """
    barrier = threading.Barrier(world, timeout=timeout)
    slots: list = [None] * world

    def collective(rank: int, t: torch.Tensor, combine: Callable[[list], torch.Tensor]) -> torch.Tensor:
        slots[rank] = t.detach().clone()
        barrier.wait()
        out = combine(list(slots))
        barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def total(ts: list) -> torch.Tensor:
        out = ts[0].clone()
        for t in ts[1:]:
            out = out + t
        return out

    def extreme(op: Callable) -> Callable[[list], torch.Tensor]:
        def combine(ts: list) -> torch.Tensor:
            out = ts[0].clone()
            for t in ts[1:]:
                out = op(out, t)
            return out
        return combine

    def reducers(rank: int) -> Reducers:
        return Reducers(world_size=world, rank=rank,
                        sum=lambda t: collective(rank, t, total),
                        max=lambda t: collective(rank, t, extreme(torch.maximum)),
                        min=lambda t: collective(rank, t, extreme(torch.minimum)),
                        gather=lambda t: collective(rank, t, torch.cat))

    results: list = [None] * world
    errors: list = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, reducers(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None or any(errors):
        raise first or next(e for e in errors if e is not None)
    return results
