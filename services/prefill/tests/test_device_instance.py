"""A real prefill instance process started with `--device cpu` on a mesh data plane, this test process its peer.

The instance reports the transport of each of its data-plane pairs in its stats (`dataplane_<path>_peers`, for paths
other than plain gloo). This process joins the mesh twice: announcing a GPU placement first (announcing checks
nothing, so a CPU machine can play a GPU peer), which the instance must reach host-staged, then as a CPU rank again,
which leaves the instance's stats as a CPU stack always had them (no counters).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spindle_protocol import Bus, decode, subjects
from spindle_protocol.messages import InstanceInfo, InstanceStats, StatsQuery
from spindle_protocol.nats_server import NatsServer, start_nats_server
from spindle_protocol.registry import registry_bucket
from spindle_transfer import DataPlane
from spindle_transfer.testing import free_port

IID = "prefill-dev"
READY_S = 120.0


def _wait(what: str, check: Callable[[], bool], timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"the instance exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


async def _stats(url: str) -> InstanceStats | None:
    bus = await Bus.connect(url, "device-test")
    try:
        return await bus.request(subjects.instance_stats(IID), StatsQuery(), InstanceStats, timeout=1.0)
    except Exception:
        return None
    finally:
        await bus.close()


def stats(nats: NatsServer) -> InstanceStats | None:
    return asyncio.run(_stats(nats.url))


async def _heartbeat(url: str) -> InstanceInfo | None:
    bus = await Bus.connect(url, "device-test")
    try:
        return decode((await (await registry_bucket(bus)).get(IID)).value, InstanceInfo)
    except Exception:  # not registered yet
        return None
    finally:
        await bus.close()


def heartbeat(nats: NatsServer) -> InstanceInfo | None:
    return asyncio.run(_heartbeat(nats.url))


@pytest.fixture
def nats() -> Iterator[NatsServer]:
    server = start_nats_server()
    try:
        yield server
    finally:
        server.stop()


def test_an_instance_started_with_device_cpu_serves_and_names_its_paths(nats: NatsServer, tmp_path: Path) -> None:
    port = free_port()
    rendezvous = subprocess.Popen([sys.executable, "-m", "spindle_transfer.rendezvous", "--port", str(port)])
    log = tmp_path / "prefill.log"
    cmd = [sys.executable, "-m", "spindle_prefill", "--instance-id", IID, "--rank", "0", "--world-size", "2"]
    cmd += ["--dist-init", f"mesh://127.0.0.1:{port}", "--nats-url", nats.url, "--device", "cpu"]
    cmd += ["--kv-cache-tokens", "512", "--max-model-len", "512"]
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, "HF_HUB_OFFLINE": "1"})
    plane = None
    try:
        _wait("stats", lambda: stats(nats) is not None, READY_S, proc, log)
        assert "ready (rank 0 on cpu" in log.read_text()
        _wait("a heartbeat", lambda: heartbeat(nats) is not None, 10, proc, log)
        assert heartbeat(nats).device == "cpu"  # type: ignore[union-attr]

        plane = DataPlane.init(1, 2, f"mesh://127.0.0.1:{port}", device="cuda:0", timeout_s=30)
        _wait("a host-staged pair", lambda: (s := stats(nats)) is not None and s.counters == {
            "dataplane_host_staged_peers": 1}, 30, proc, log)  # fmt: skip
        assert plane.paths() == {0: "host-staged"}
        assert "path host-staged (cpu and cuda:0)" in log.read_text()
        plane.close()

        plane = DataPlane.init(1, 2, f"mesh://127.0.0.1:{port}", device="cpu", timeout_s=30)
        assert plane.mesh is not None and plane.mesh.wait_formed(30) == {}
        assert plane.paths() == {0: "gloo"}
        _wait("a gloo pair", lambda: (s := stats(nats)) is not None and s.counters == {}, 30, proc, log)
        assert stats(nats).role == "prefill"  # type: ignore[union-attr]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if plane is not None:
            plane.close()
        for p in (proc, rendezvous):
            if p.poll() is None:
                p.kill()
                p.wait()
