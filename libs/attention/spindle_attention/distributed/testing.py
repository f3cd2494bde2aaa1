"""Run a function on a real local gloo group (tests and benchmarks).

`run_group(fn, world_size, *args)` forks `world_size` processes, joins them into one gloo group on
127.0.0.1 and a free port, calls `fn(rank, world_size, *args)` in each and raises if any rank fails or the
group does not finish within `timeout` seconds. Fork (not spawn) keeps start-up well under a second.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_group(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run `fn(rank, world_size, *args)` on every rank of a fresh gloo group; raise on any failure."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False, start_method="fork"
    )
    try:
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):  # False: some rank still running
            if time.monotonic() >= deadline:
                raise TimeoutError(f"group of {world_size} did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
