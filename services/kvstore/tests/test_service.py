"""A real kvstore process (rank 0) on a real nats-server; this test process is data-plane rank 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spindle_protocol import Bus, decode, header_for, subjects
from spindle_protocol.messages import (
    Abort,
    InstanceInfo,
    InstanceStats,
    KVFree,
    KVFreeReply,
    KVGet,
    KVGetReply,
    KVPut,
    ReserveReply,
    StatsQuery,
)
from spindle_protocol.nats_server import start_nats_server
from spindle_protocol.registry import registry_bucket
from spindle_transfer import DataPlane, TransferError, header_of
from spindle_transfer.testing import bitwise_equal, free_port

IID = "kvstore-test"
BUDGET = 2**20  # --memory-gb 1/1024
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}


class Stack:
    def __init__(self, nats_url: str, plane: DataPlane, trace_file: Path) -> None:
        self.nats_url = nats_url
        self.plane = plane
        self.trace_file = trace_file


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    trace_file = tmp_path_factory.mktemp("kvstore") / "spans.jsonl"
    nats = start_nats_server()
    port = free_port()
    env = {**os.environ, "SPINDLE_TRACE_FILE": str(trace_file)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    # -X faulthandler: a kvstore that does not exit on SIGTERM gets SIGABRT and prints every thread's stack
    cmd = [sys.executable, "-X", "faulthandler", "-m", "spindle_kvstore", "--rank", "0", "--world-size", "2"]
    cmd += ["--instance-id", IID, "--dist-init", f"tcp://127.0.0.1:{port}", "--nats-url", nats.url]
    cmd += ["--memory-gb", str(BUDGET / 2**30)]
    log_path = tmp_path_factory.mktemp("kvstore-log") / "kvstore.log"
    log_file = log_path.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    plane = None
    try:
        plane = DataPlane.init(1, 2, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=30)
        asyncio.run(_wait_ready(nats.url, proc))
        yield Stack(nats.url, plane, trace_file)
        assert proc.poll() is None, "the kvstore died during the tests"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if plane is not None:
            plane.close()
        nats.stop()
        log_file.close()
    tail = "\n".join(log_path.read_text().splitlines()[-60:])
    assert proc.returncode == 0, f"the kvstore exited with {proc.returncode} on SIGTERM; its log ends:\n{tail}"


async def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    bus = await Bus.connect(url, "kvstore-test-ready")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the kvstore exited during start-up"
            try:
                await bus.request(subjects.instance_stats(IID), StatsQuery(), InstanceStats, timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.1)
        raise TimeoutError("the kvstore did not answer stats")
    finally:
        await bus.close()


def run(stack: Stack, scenario: Callable[[Bus], Any]) -> Any:
    async def main() -> Any:
        bus = await Bus.connect(stack.nats_url, "kvstore-test")
        try:
            return await scenario(bus)
        finally:
            await bus.close()

    return asyncio.run(main())


async def stats(bus: Bus) -> InstanceStats:
    return await bus.request(subjects.instance_stats(IID), StatsQuery(), InstanceStats)


async def put(bus: Bus, plane: DataPlane, rid: str, kv: torch.Tensor, start: int = 0) -> ReserveReply:
    msg = KVPut(request_id=rid, start=start, end=start + kv.shape[2], src_rank=1, kv=header_of(kv))
    reply = await bus.request(subjects.kvstore_put(IID), msg, ReserveReply, headers=TRACEPARENT)
    if reply.accepted:
        await plane.send_async(kv, 0, reply.tag, header_of(kv), timeout_s=10)
    return reply


async def get(bus: Bus, plane: DataPlane, rid: str, start: int, end: int, free_after: bool = False):
    """Ask for tokens [start, end); the receive is posted only once the reply names the header (the kvstore's
    send waits for it; the decode worker instead posts first, from the header it already knows)."""
    tag = plane.new_tag()
    msg = KVGet(request_id=rid, start=start, end=end, dst_rank=1, tag=tag, free_after=free_after)
    reply = await bus.request(subjects.kvstore_get(IID), msg, KVGetReply, headers=TRACEPARENT)
    got = await plane.recv_async(reply.kv, 0, tag, timeout_s=10) if reply.found else None
    return reply, got


async def wait_until(bus: Bus, check: Callable[[InstanceStats], bool], timeout: float = 3.0) -> InstanceStats:
    deadline = time.monotonic() + timeout
    while True:
        s = await stats(bus)
        if check(s) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


def kv(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, tokens, 3, 8, generator=g).to(dtype)


def test_put_get_free_round_trip(stack: Stack) -> None:
    a, b = kv(17, 1), kv(9, 2, torch.float32)

    async def scenario(bus: Bus) -> None:
        assert (await put(bus, stack.plane, "r1", a)).accepted
        # got right after the send returned: the kvstore may still be committing it
        reply, got = await get(bus, stack.plane, "r1", 0, 17)
        assert reply.found and reply.kv == header_of(a) and bitwise_equal(got, a)
        reply, got = await get(bus, stack.plane, "r1", 5, 12)
        assert reply.found and bitwise_equal(got, a[:, :, 5:12].contiguous())
        assert (await put(bus, stack.plane, "r2", b, start=100)).accepted
        s = await wait_until(bus, lambda s: "r2" in s.requests)
        assert s.requests == {"r1": a.nbytes, "r2": b.nbytes} and s.kv_blocks_used == a.nbytes + b.nbytes
        assert s.kv_blocks_total == BUDGET and s.role == "kvstore"
        freed = await bus.request(subjects.kvstore_free(IID), KVFree(request_id="r1"), KVFreeReply)
        assert freed.freed_bytes == a.nbytes
        reply, _ = await get(bus, stack.plane, "r1", 0, 17)
        assert not reply.found
        reply, got = await get(bus, stack.plane, "r2", 100, 109, free_after=True)
        assert reply.found and bitwise_equal(got, b)
        s = await wait_until(bus, lambda s: not s.requests)
        assert s.requests == {} and s.kv_blocks_used == 0

    run(stack, scenario)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_tier_takes_from_and_returns_to_the_callers_device(stack: Stack, device: str) -> None:
    """A caller's KV on `device` goes to the host tier (staged through pinned host memory off the CPU) and comes
    back onto `device`, into a fresh tensor or the caller's `out`."""
    a = kv(11, 3).to(device)

    async def scenario(bus: Bus) -> None:
        rid = f"dev-{device}"
        assert (await put(bus, stack.plane, rid, a)).accepted
        await wait_until(bus, lambda s: rid in s.requests)
        for out in (None, torch.empty_like(a)):
            tag = stack.plane.new_tag()
            msg = KVGet(request_id=rid, start=0, end=11, dst_rank=1, tag=tag)
            reply = await bus.request(subjects.kvstore_get(IID), msg, KVGetReply)
            assert reply.found and reply.kv == header_of(a)
            got = await stack.plane.recv_async(reply.kv, 0, tag, out=out, timeout_s=10, device=device)
            assert got.device == a.device and bitwise_equal(got.cpu(), a.cpu())
            assert out is None or got is out
        await bus.request(subjects.kvstore_free(IID), KVFree(request_id=rid), KVFreeReply)

    run(stack, scenario)


def test_refusals(stack: Stack) -> None:
    async def scenario(bus: Bus) -> None:
        too_big = header_for("float32", [2, 30, 300, 3, 64])
        msg = KVPut(request_id="big", start=0, end=300, src_rank=1, kv=too_big)
        reply = await bus.request(subjects.kvstore_put(IID), msg, ReserveReply)
        assert not reply.accepted and reply.reason == "no_space"
        bad = KVPut(request_id="bad", start=0, end=10, src_rank=1, kv=header_for("float32", [2, 3, 9, 3, 8]))
        reply = await bus.request(subjects.kvstore_put(IID), bad, ReserveReply)
        assert not reply.accepted and reply.reason == "bad_header"
        itself = KVPut(request_id="bad", start=0, end=9, src_rank=0, kv=header_for("float32", [2, 3, 9, 3, 8]))
        reply = await bus.request(subjects.kvstore_put(IID), itself, ReserveReply)
        assert not reply.accepted and reply.reason == "bad_header"
        assert (await stats(bus)).kv_blocks_used == 0

    run(stack, scenario)


def test_abort_frees_stored_and_in_flight(stack: Stack) -> None:
    stored, never_sent = kv(20, 3), kv(8, 4)

    async def scenario(bus: Bus) -> None:
        assert (await put(bus, stack.plane, "r3", stored)).accepted
        pending = KVPut(request_id="r4", start=0, end=8, src_rank=1, kv=header_of(never_sent))
        reserved = await bus.request(subjects.kvstore_put(IID), pending, ReserveReply)
        assert reserved.accepted
        s = await wait_until(bus, lambda s: "r3" in s.requests)
        assert s.requests == {"r3": stored.nbytes, "r4": never_sent.nbytes}
        t0 = time.monotonic()
        await bus.publish(subjects.ABORT, Abort(request_id="r3"))
        await bus.publish(subjects.ABORT, Abort(request_id="r4"))
        s = await wait_until(bus, lambda s: not s.requests)
        assert s.requests == {} and s.kv_blocks_used == 0 and time.monotonic() - t0 < 1.0
        # the cancelled receive refuses the late sender instead of leaving it blocked
        with pytest.raises(TransferError, match="cancelled"):
            await stack.plane.send_async(never_sent, 0, reserved.tag, header_of(never_sent), timeout_s=5)
        again = await bus.request(subjects.kvstore_put(IID), pending, ReserveReply)
        assert not again.accepted and again.reason == "aborted"

    run(stack, scenario)


def test_registry_heartbeat(stack: Stack) -> None:
    async def scenario(bus: Bus) -> InstanceInfo:
        kv_bucket = await registry_bucket(bus)
        return decode((await kv_bucket.get(IID)).value, InstanceInfo)

    info = run(stack, scenario)
    assert info.role == "kvstore" and info.rank == 0 and info.kv_bytes_total == BUDGET and info.device == "cpu"
    assert time.time() - info.updated_at < 3


def test_spans_continue_the_callers_trace(stack: Stack) -> None:
    async def scenario(bus: Bus) -> None:
        assert (await put(bus, stack.plane, "traced", kv(4, 5))).accepted
        assert (await get(bus, stack.plane, "traced", 0, 4, free_after=True))[0].found

    run(stack, scenario)
    deadline = time.monotonic() + 5
    names: set[str] = set()
    while time.monotonic() < deadline:
        if stack.trace_file.exists():
            spans = [json.loads(line) for line in stack.trace_file.read_text().splitlines() if line]
            ours = [s for s in spans if s["trace_id"] == TRACE_ID and s["parent_id"] == PARENT_ID]
            names = {s["name"] for s in ours}
            if {"kvstore.put", "kvstore.get"} <= names:
                break
        time.sleep(0.1)
    assert {"kvstore.put", "kvstore.get"} <= names
