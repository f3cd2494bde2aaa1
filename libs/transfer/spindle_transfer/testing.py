"""Multi-process checks of the data plane on a real gloo group (used by the tests; also `python -m`).

Workers are module-level so spawned processes can import them; results come back as JSON files.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spindle_protocol import header_for

from .dataplane import DataPlane
from .wire import DTYPES

SENDER, RECEIVER = 0, 1
ROUND_TRIP_CASES = [
    ("float32", (2, 3, 7, 5, 1)),
    ("bfloat16", (2, 3, 17, 3, 8)),
    ("float16", (5, 3)),
    ("int64", (1,)),
    ("int32", (3, 1, 2)),
    ("uint8", (1001,)),
    ("float32", (3, 0)),
    ("bfloat16", (2, 30, 129, 3, 64)),  # a few MB
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in ("float32", "bfloat16", "float16"):
        return (torch.randn(shape, generator=g) * 100).to(DTYPES[dtype])
    return torch.randint(0, 250, shape, generator=g).to(DTYPES[dtype])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _timed(fn: Callable[[], Any]) -> tuple[str, float, str]:
    """Run fn; return the exception class name it raised ("ok" if none), the seconds it took, the message."""
    t0 = time.monotonic()
    try:
        fn()
        outcome, message = "ok", ""
    except Exception as e:
        outcome, message = type(e).__name__, str(e)
    return outcome, time.monotonic() - t0, message


def two_rank_checks(plane: DataPlane, results: dict[str, Any], save: Callable[[], None]) -> None:
    """Round trips, concurrency, header mismatch, cancel/timeout on both sides, then a dying peer."""
    rank = plane.rank
    # 1. bitwise round trips, odd shapes, with and without `out`; the sender's tensor is not contiguous
    for i, (dtype, shape) in enumerate(ROUND_TRIP_CASES):
        header, tag = header_for(dtype, shape), 100 + i
        if rank == SENDER:
            t = make_tensor(dtype, shape[::-1], i).permute(*reversed(range(len(shape))))
            plane.send(t, RECEIVER, tag, header)
        else:
            out = torch.empty(shape, dtype=DTYPES[dtype]) if i % 2 else None
            got = plane.recv(header, SENDER, tag, out=out)
            expect = make_tensor(dtype, shape[::-1], i).permute(*reversed(range(len(shape))))
            results[f"roundtrip_{i}"] = bitwise_equal(got, expect.contiguous()) and (out is None or got is out)

    # 2. two concurrent transfers between the same pair, posted and sent in opposite orders
    a, b = ("float32", (2, 4, 300, 3, 64)), ("bfloat16", (2, 4, 301, 3, 64))

    async def concurrent() -> None:
        if rank == SENDER:
            await asyncio.gather(
                plane.send_async(make_tensor(*b, 21), RECEIVER, 202, header_for(*b)),
                plane.send_async(make_tensor(*a, 20), RECEIVER, 201, header_for(*a)),
            )
        else:
            ga, gb = await asyncio.gather(
                plane.recv_async(header_for(*a), SENDER, 201), plane.recv_async(header_for(*b), SENDER, 202)
            )
            results["concurrent"] = bitwise_equal(ga, make_tensor(*a, 20)) and bitwise_equal(gb, make_tensor(*b, 21))

    asyncio.run(concurrent())

    # 3. header mismatch: wrong shape, then wrong dtype; both sides raise, then the pair still works
    sent = make_tensor("float32", (4, 5), 30)
    for tag, expect in ((301, header_for("float32", [5, 4])), (302, header_for("bfloat16", [4, 5]))):
        if rank == SENDER:
            send = partial(plane.send, sent, RECEIVER, tag, header_for("float32", [4, 5]))
            results[f"mismatch_sender_{tag}"] = _timed(send)[0]
        else:
            results[f"mismatch_receiver_{tag}"] = _timed(partial(plane.recv, expect, SENDER, tag))[0]
    _check_pair(plane, results, 303, "after_mismatch")

    # 4. receiver-side cancel and timeout with no sender, then late senders are refused, not hung
    small = header_for("float32", [3])
    if rank == RECEIVER:
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        results["cancel"] = _timed(lambda: plane.recv(small, SENDER, 401, cancel=cancel))
        results["timeout"] = _timed(lambda: plane.recv(small, SENDER, 402, timeout_s=0.5))

        async def cancelled_task() -> None:
            task = asyncio.create_task(plane.recv_async(small, SENDER, 405))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(cancelled_task())
    dist.barrier()
    if rank == SENDER:
        results["late_send_401"] = _timed(lambda: plane.send(torch.ones(3), RECEIVER, 401, small, timeout_s=5))
        results["late_send_402"] = _timed(lambda: plane.send(torch.ones(3), RECEIVER, 402, small, timeout_s=5))
        results["late_send_405"] = _timed(lambda: plane.send(torch.ones(3), RECEIVER, 405, small, timeout_s=5))
        # sender-side timeout: the receiver posts nothing yet
        results["sender_timeout"] = _timed(lambda: plane.send(torch.ones(3), RECEIVER, 403, small, timeout_s=0.5))
    dist.barrier()
    if rank == RECEIVER:  # the abandoned send finishes the exchange with ABORT: refused, not hung
        results["late_recv_403"] = _timed(lambda: plane.recv(small, SENDER, 403, timeout_s=5))
    _check_pair(plane, results, 404, "after_cancel")

    # 5. a peer that dies while the receiver waits: TransferError well within the timeout
    dist.barrier()
    if rank == SENDER:
        save()
        time.sleep(0.5)
        os._exit(0)
    results["dead_peer"] = _timed(lambda: plane.recv(small, SENDER, 501, timeout_s=20))


def _check_pair(plane: DataPlane, results: dict[str, Any], tag: int, key: str) -> None:
    t = make_tensor("float32", (2, 3), tag)
    if plane.rank == SENDER:
        plane.send(t, RECEIVER, tag, header_for("float32", [2, 3]))
    else:
        results[key] = bitwise_equal(plane.recv(header_for("float32", [2, 3]), SENDER, tag), t)


CHECKS = {"two_rank_checks": two_rank_checks}


def _entry(rank: int, world: int, port: int, out_dir: str, check: str) -> None:
    torch.set_num_threads(1)
    plane = DataPlane.init(rank, world, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=30)
    results: dict[str, Any] = {}
    path = Path(out_dir) / f"rank{rank}.json"

    def save() -> None:
        path.write_text(json.dumps(results))

    try:
        CHECKS[check](plane, results, save)
        save()
    finally:
        plane.close()


def run_ranks(check: str, world: int, out_dir: Path, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run CHECKS[check] on `world` spawned ranks of one gloo group; return each rank's results."""
    ctx = mp.start_processes(
        _entry, args=(world, free_port(), str(out_dir), check), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{check} did not finish in {timeout} s")
    out = []
    for r in range(world):
        p = Path(out_dir) / f"rank{r}.json"
        out.append(json.loads(p.read_text()) if p.exists() else {})
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run_ranks("two_rank_checks", 2, Path(d)), indent=1))
