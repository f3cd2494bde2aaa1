"""Run one measurement function on N spawned ranks, with a deadline (the SP and transfer measurements)."""

from __future__ import annotations

import time
from collections.abc import Callable


def run_ranks(fn: Callable[..., None], nprocs: int, args: tuple, timeout_s: float, what: str) -> None:
    """Run `fn(rank, *args)` in `nprocs` spawned processes; kill them all if they take over `timeout_s`.

    `fn` must be a module-level function: each spawned process imports it by name."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
