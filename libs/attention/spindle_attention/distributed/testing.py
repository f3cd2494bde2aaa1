"""Run a function on a real local gloo group (tests and benchmarks).

`run_group(fn, world_size, *args)` forks `world_size` processes, joins them into one gloo group on
127.0.0.1 and a free port, calls `fn(rank, world_size, *args)` in each and raises if any rank fails or the
group does not finish within `timeout` seconds. Fork (not spawn) keeps start-up well under a second; a run that
uses CUDA in its ranks spawns them (`start_method="spawn"`, with `fn` importable: defined in a module, as
`staging_check` here is).

`PairRouter` routes `p2p` through one gloo group per pair of ranks, as spindle_transfer's `Mesh` does.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import p2p, staging
from .comm import wait


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


def run_group(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, start_method: str = "fork"
) -> None:
    """Run `fn(rank, world_size, *args)` on every rank of a fresh gloo group; raise on any failure."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False, start_method=start_method
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


class PairRouter:
    """A `p2p.Router` over one gloo group per pair of ranks of the default group, formed here on every rank (as
    spindle_transfer's `Mesh` forms its pair groups, without its comings and goings)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        self._rank = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
        self._groups: dict[int, dist.ProcessGroup] = {}
        world = dist.get_world_size()
        # every rank forms its pairs in the same (lexicographic) order, so none waits on a cycle
        for lo in range(world):
            for hi in range(lo + 1, world):
                if self._rank in (lo, hi):
                    prefixed = dist.PrefixStore(f"pair/{lo}/{hi}", store)
                    peer = hi if self._rank == lo else lo
                    self._groups[peer] = dist.ProcessGroupGloo(prefixed, int(self._rank == hi), 2, timeout)

    @property
    def rank(self) -> int:
        return self._rank

    def route(self, peer: int) -> tuple[dist.ProcessGroup, int]:
        return self._groups[peer], int(peer > self._rank)


def _payload(sender: int, case: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """What `sender` sends in `case`: distinct values per sender and case, the same on every rank."""
    n = 1
    for s in shape:
        n *= s
    values = torch.arange(n, dtype=torch.float64) * 0.5 + 100 * sender + 10 * case
    return values.to(dtype).view(shape).to(device)


def staging_check(rank: int, world_size: int, device: str, routed: bool, force: bool) -> None:
    """Two ranks exchange tensors on `device` through `p2p` and check what lands: on the default gloo group or
    routed over a `PairRouter`; with `force`, CPU tensors are staged too (`staging.FORCE_FOR_TESTS`).

    Covers: contiguous and strided (staged only: plain gloo takes contiguous tensors) sends and receives of
    several dtypes, a staged recv leaving the caller's tensor untouched until `wait()` and copying once, a wait on
    another thread, a batch, and the handles' type (`dist.Work`; `StagedRecv` exactly when staged).
    """
    if world_size != 2:
        raise ValueError(f"staging_check runs on 2 ranks, got {world_size}")
    dev, peer = torch.device(device), 1 - rank
    staging.FORCE_FOR_TESTS = force
    if routed:
        p2p.install(PairRouter())
    staged = force or staging.needs_staging(dev.type, "gloo")
    try:
        # 1. both ways at once, several dtypes; staged: from a strided view into a strided view
        cases = [(torch.float32, (4, 6)), (torch.bfloat16, (3, 5, 2)), (torch.int64, (7,))]
        for i, (dtype, shape) in enumerate(cases):
            wide = (*shape[:-1], 2 * shape[-1])
            mine = _payload(rank, i, dtype, shape, dev)
            send = mine
            recv_wide = torch.full(wide, -1, dtype=dtype, device=dev)
            recv = torch.full(shape, -1, dtype=dtype, device=dev)
            if staged:
                send = torch.zeros(wide, dtype=dtype, device=dev)
                send[..., ::2] = mine
                send = send[..., ::2]  # [*shape], strided
                recv = recv_wide[..., 1::2]  # [*shape], strided: the other half must stay untouched
            assert staged or (send.is_contiguous() and recv.is_contiguous())
            works = [p2p.irecv(recv, peer, tag=i), p2p.isend(send, peer, tag=i)]
            assert all(isinstance(w, dist.Work) for w in works)
            assert isinstance(works[0], staging.StagedRecv) == staged
            for w in works:
                w.wait()
            assert torch.equal(recv, _payload(peer, i, dtype, shape, dev)), f"case {i}: wrong data"
            if staged:
                assert bool((recv_wide[..., ::2] == -1).all()), f"case {i}: a strided recv wrote outside its view"

        # 2. the deferred copy: rank 1 receives a, then b (sent after a); a lands only at its wait()
        a_shape, b_shape = (16, 3), (2,)
        if rank == 0:
            works = [p2p.isend(_payload(0, 10, torch.float32, a_shape, dev), 1, tag=10)]
            works.append(p2p.isend(_payload(0, 11, torch.float32, b_shape, dev), 1, tag=11))
            for w in works:
                w.wait()
        else:
            a = torch.full(a_shape, -1.0, device=dev)
            b = torch.full(b_shape, -1.0, device=dev)
            wa = p2p.irecv(a, 0, tag=10)
            p2p.irecv(b, 0, tag=11).wait()  # b came after a over the same pair: a's bytes are here too
            if staged:
                assert bool((a == -1).all()), "a staged recv wrote the caller's tensor before wait()"
                assert not wa.is_completed()
            assert wa.wait(timedelta(seconds=60))
            assert wa.is_completed()
            assert torch.equal(a, _payload(0, 10, torch.float32, a_shape, dev))
            if staged:
                a.fill_(-2.0)
                assert wa.wait()  # a second wait returns at once and copies nothing
                assert bool((a == -2).all()), "a second wait() copied again"

        # 3. the recv waited for on another thread (as the engine's waiters do), then read on this one
        got = torch.full((5, 4), -1.0, device=dev)
        work = p2p.irecv(got, peer, tag=20)
        waiter = threading.Thread(target=work.wait)
        waiter.start()
        p2p.isend(_payload(rank, 20, torch.float32, (5, 4), dev), peer, tag=20).wait()
        waiter.join(60)
        assert not waiter.is_alive(), "the waiting thread never returned"
        assert work.is_completed() or not staged
        assert torch.equal(got, _payload(peer, 20, torch.float32, (5, 4), dev))

        # 4. a batch, as ring attention and the RankGroup exchanges post them
        out = torch.full((3, 8), -1.0, device=dev)
        ops = [
            p2p.Op(p2p.isend, _payload(rank, 30, torch.float32, (3, 8), dev), peer, None, 30),
            p2p.Op(p2p.irecv, out, peer, None, 30),
        ]
        for w in p2p.batch_isend_irecv(ops):
            wait(w)
        assert torch.equal(out, _payload(peer, 30, torch.float32, (3, 8), dev))
    finally:
        p2p.install(None)
        staging.FORCE_FOR_TESTS = False
