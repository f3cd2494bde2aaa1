"""The SCRIPTED NATS PEER of the gateway tests: it stands in for the scheduler and the workers over a real
nats-server, so the gateway can be checked in isolation (the real services' end-to-end tests are elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from nats.aio.msg import Msg

from spindle_model import Tokenizer
from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    Abort,
    AdmitReply,
    AdmitRequest,
    ClusterStatus,
    InstanceInfo,
    InstanceStats,
    RequestSpec,
    StatsQuery,
    StatusQuery,
    StreamEvent,
)

MODEL = "smollm2"
ANSWER = "The capital of France is Paris."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway_process(nats_url: str, *args: str) -> tuple[subprocess.Popen, str]:
    """`python -m spindle_gateway` as a real process on a free port, once its /health answers 200: (process, URL).
    The caller stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "spindle_gateway", "--nats-url", nats_url, "--port", str(port), *args]
    env = {**os.environ, "SPINDLE_PARENT_PID": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(healthy, 90, 0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def wait_until(predicate: Callable[[], bool], timeout: float = 2.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def token_events(
    request_id: str,
    tokens: list[int],
    finish_reason: str = "stop",
    per_event: int = 1,
    stats: dict[str, float] | None = None,
) -> list[StreamEvent]:
    """The in-order token stream of a request: `per_event` tokens per event, the last event `finished`."""
    events = []
    for start in range(0, len(tokens), per_event):
        chunk = tokens[start : start + per_event]
        last = start + per_event >= len(tokens)
        events.append(
            StreamEvent(
                request_id=request_id,
                seq=start,
                token_ids=chunk,
                finished=last,
                finish_reason=finish_reason if last else None,
                stats=stats if last else None,
            )
        )
    return events


def instance(
    instance_id: str, role: str, rank: int, used: int = 0, total: int = 100, device: str = "cpu"
) -> InstanceInfo:
    now = time.time()
    return InstanceInfo(
        instance_id=instance_id,
        role=role,
        rank=rank,
        pid=1,
        started_at=now,
        updated_at=now,
        kv_blocks_total=total,
        kv_blocks_used=used,
        block_size=16,
        max_model_len=8192,
        device=device,
    )


def healthy_status() -> ClusterStatus:
    insts = [
        instance("prefill-0", "prefill", 1, used=10),
        instance("decode-0", "decode", 2, used=30, device="cuda:1"),
        instance("kvstore-0", "kvstore", 0),
    ]
    return ClusterStatus(
        instances=insts,
        dead_instances=[],
        num_requests_running=2,
        num_requests_waiting=1,
        strategy="single",
        max_model_len=8192,
        model=MODEL,
    )


class ScriptedPeer:
    """SCRIPTED NATS PEER playing the scheduler and the workers for gateway conformance tests.

    - ADMIT: records the AdmitRequest (and its headers) and answers `admit_reply` (None: never answers).
    - For each accepted request, publishes the StreamEvents `script(spec)` returns on the request's stream subject,
      `interval` seconds apart, stopping early when an Abort for the request arrives (as a worker would).
    - STATUS: answers `status` (None: no answer). Instance stats: answers for each instance in `status`.
    - ABORT: records every Abort.
    """

    def __init__(self, bus: Bus, tokenizer: Tokenizer) -> None:
        self.bus = bus
        self.tokenizer = tokenizer
        self._subs: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
        self.reset()

    def reset(self) -> None:
        self.admits: list[RequestSpec] = []
        self.admit_headers: list[dict[str, str]] = []
        self.aborts: list[Abort] = []
        self.admit_reply: AdmitReply | None = AdmitReply(
            accepted=True, prefill_instance="prefill-0", decode_instance="decode-0"
        )
        self.script: Callable[[RequestSpec], list[StreamEvent]] = self.answer_script
        self.interval = 0.0
        self.status: ClusterStatus | None = healthy_status()

    def answer_tokens(self) -> list[int]:
        return [*self.tokenizer.encode(ANSWER, add_special_tokens=False), 2]  # + EOS (special: no text)

    def answer_script(self, spec: RequestSpec) -> list[StreamEvent]:
        return token_events(spec.request_id, self.answer_tokens(), stats={"decode_ms": 1.5})

    def endless_script(self, text: str = " tick") -> Callable[[RequestSpec], list[StreamEvent]]:
        """Tokens of `text` repeated (as good as) forever: only an Abort or the deadline ends the request."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)

        def script(spec: RequestSpec) -> list[StreamEvent]:
            return [StreamEvent(request_id=spec.request_id, seq=i, token_ids=[ids[i % len(ids)]]) for i in range(5000)]

        return script

    def aborted(self, request_id: str) -> bool:
        return any(a.request_id == request_id for a in self.aborts)

    async def start(self) -> None:
        self._subs["admit"] = await self.bus.subscribe(subjects.ADMIT, AdmitRequest, self._on_admit)
        self._subs["status"] = await self.bus.subscribe(subjects.STATUS, StatusQuery, self._on_status)
        self._subs["abort"] = await self.bus.subscribe(subjects.ABORT, Abort, self._on_abort)
        self._subs["stats"] = await self.bus.subscribe("spindle.instance.*.stats", StatsQuery, self._on_stats)
        await self.bus.nc.flush()

    async def set_admitting(self, on: bool) -> None:
        """Off: nobody subscribes to ADMIT (the gateway's request gets NoResponders)."""
        if not on and "admit" in self._subs:
            await self._subs.pop("admit").unsubscribe()
        elif on and "admit" not in self._subs:
            self._subs["admit"] = await self.bus.subscribe(subjects.ADMIT, AdmitRequest, self._on_admit)
        await self.bus.nc.flush()

    async def _on_admit(self, req: AdmitRequest, msg: Msg) -> AdmitReply | None:
        self.admits.append(req.request)
        self.admit_headers.append(dict(msg.headers or {}))
        reply = self.admit_reply
        if reply is not None and reply.accepted:
            task = asyncio.get_running_loop().create_task(self._play(req.request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return reply

    async def _play(self, spec: RequestSpec) -> None:
        for event in self.script(spec):
            if self.aborted(spec.request_id):
                return
            await self.bus.publish(subjects.stream(spec.request_id), event)
            if self.interval:
                await asyncio.sleep(self.interval)

    async def _on_status(self, _: StatusQuery, msg: Msg) -> ClusterStatus | None:
        return self.status

    async def _on_abort(self, abort: Abort, msg: Msg) -> None:
        self.aborts.append(abort)

    async def _on_stats(self, _: StatsQuery, msg: Msg) -> InstanceStats | None:
        instance_id = msg.subject.split(".")[2]
        for inst in self.status.instances if self.status else []:
            if inst.instance_id == instance_id:
                return InstanceStats(
                    instance_id=instance_id,
                    role=inst.role,
                    kv_blocks_total=inst.kv_blocks_total,
                    kv_blocks_used=0,
                    requests={},
                )
        return None

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
