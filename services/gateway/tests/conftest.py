"""Fixtures of the gateway tests: a real nats-server, the real gateway app served by uvicorn on a free loopback
port, and a SCRIPTED NATS PEER that stands in for the scheduler and the workers.

The gateway and the scripted peer share one event loop in a background thread (each with its own NATS
connection, as separate services would have); the tests are plain synchronous functions that talk HTTP to the
gateway and read what the scripted peer saw. These tests check the gateway in isolation; the real services'
end-to-end tests live in the repository's tests/.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import uvicorn

from spindle_gateway import GatewayConfig, GatewayState, create_app, tracing
from spindle_model import Tokenizer, resolve_model
from spindle_protocol.bus import Bus
from spindle_protocol.nats_server import NatsServer, start_nats_server

from .scripted_peer import MODEL, ScriptedPeer, free_port


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals stay with pytest (the server runs in a background thread anyway)


class RunningGateway:
    """The real gateway app on a real port, created on the harness loop."""

    def __init__(self, state: GatewayState, server: uvicorn.Server, task: asyncio.Task, url: str) -> None:
        self.state = state
        self.server = server
        self.task = task
        self.url = url

    @classmethod
    async def start(cls, nats_url: str, tokenizer: Tokenizer, **overrides: Any) -> RunningGateway:
        settings: dict[str, Any] = {
            "served_model_name": MODEL,
            "model": MODEL,
            "max_model_len": 8192,
            "vocab_size": 49152,
        }
        settings.update(overrides)
        bus = await Bus.connect(nats_url, "test-gateway", inject=tracing.inject_hook())
        state = GatewayState(GatewayConfig(**settings), tokenizer, bus)
        if state.dashboard is not None:
            await state.dashboard.start()
        port = free_port()
        server = _Server(
            uvicorn.Config(
                create_app(state),
                host="127.0.0.1",
                port=port,
                lifespan="off",
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=2,
            )
        )
        task = asyncio.get_running_loop().create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        if state.batch_runner is not None:
            state.batch_runner.resume()  # as the gateway's serve() does
        return cls(state, server, task, f"http://127.0.0.1:{port}")

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.state.drain(timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 5.0)
        await self.state.bus.close()


class Harness:
    """A background event loop holding the gateway(s) and the scripted peer."""

    def __init__(self, nats: NatsServer, tokenizer: Tokenizer) -> None:
        self.nats = nats
        self.tokenizer = tokenizer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-test-loop", daemon=True)
        self.thread.start()
        self.gateways: list[RunningGateway] = []
        self.peer_bus = self.call(Bus.connect(nats.url, "scripted-peer"))
        self.peer = ScriptedPeer(self.peer_bus, tokenizer)
        self.call(self.peer.start())
        self.gateway = self.start_gateway()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_gateway(self, **overrides: Any) -> RunningGateway:
        gw = self.call(RunningGateway.start(self.nats.url, self.tokenizer, **overrides))
        self.gateways.append(gw)
        return gw

    async def settle(self) -> None:
        """Wait until no request is in flight and every Abort has reached the scripted peer."""
        for _ in range(200):
            if not any(gw.state.live or gw.state._tasks for gw in self.gateways):
                break
            await asyncio.sleep(0.01)
        for gw in self.gateways:
            await gw.state.bus.nc.flush()
        await self.peer_bus.nc.flush()
        await asyncio.sleep(0.05)

    def close(self) -> None:
        try:
            for gw in self.gateways:
                self.call(gw.stop())
            self.call(self.peer.stop())
            self.call(self.peer_bus.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(MODEL).path)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = start_nats_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def harness(nats_server: NatsServer, tokenizer: Tokenizer) -> Iterator[Harness]:
    h = Harness(nats_server, tokenizer)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def peer(harness: Harness) -> Iterator[ScriptedPeer]:
    harness.peer.reset()
    harness.call(harness.peer.set_admitting(True))
    yield harness.peer
    harness.call(harness.settle())
    harness.peer.reset()


@pytest.fixture
def gateway_url(harness: Harness, peer: ScriptedPeer) -> str:
    return harness.gateway.url
