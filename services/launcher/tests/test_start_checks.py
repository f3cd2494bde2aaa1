"""What `spindle up` checks before it starts anything (taken ports, the model converted once) and that readiness
accepts only this stack's gateway, never another server on its port."""

from __future__ import annotations

import functools
import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from spindle_launcher.plan import Runtime, ServiceSpec, StackConfig
from spindle_launcher.stack import Stack, StackError, check_ports, gateway_health
from spindle_protocol.service import STACK_TOKEN_HEADER


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on (a plain socket, not an HTTP server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--nats-port"])
def test_spindle_up_on_a_taken_port_fails_at_once(taken_port: int, flag: str) -> None:
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "spindle_launcher", "up", "--port", "0", flag, str(taken_port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    seconds = time.perf_counter() - start
    print(f"\n[launcher] `spindle up {flag} {taken_port}` on a taken port exited in {seconds:.2f} s")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"port {taken_port} on 127.0.0.1 is already in use" in r.stdout
    assert "choose --port" in r.stdout if flag == "--port" else "choose --nats-port" in r.stdout
    assert "nats-server (JetStream)" not in r.stdout and "converting" not in r.stdout  # nothing started or loaded


def test_check_ports(taken_port: int) -> None:
    check_ports(StackConfig(port=0))  # 0: any free port, nothing to check
    with pytest.raises(StackError, match=f"port {taken_port} on 127.0.0.1 is already in use"):
        check_ports(StackConfig(port=taken_port))
    with pytest.raises(StackError, match=f"port {taken_port} on 0.0.0.0 is already in use"):
        check_ports(StackConfig(host="0.0.0.0", port=taken_port))
    with pytest.raises(StackError, match=r"cannot listen on 192\.0\.2\.1 port"):  # not an address of this machine
        check_ports(StackConfig(host="192.0.2.1", port=8000))


def _serve(token: str | None, status: int = 200) -> tuple[http.server.HTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            if token is not None:
                self.send_header(STACK_TOKEN_HEADER, token)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    ("answered", "status", "expected"),
    [
        ("s3cret", 200, None),
        ("s3cret", 503, "/health 503"),
        (None, 200, "another server answers there"),
        ("other-stack", 200, "another server answers there"),
    ],
)
def test_gateway_health_accepts_only_this_stacks_gateway(answered: str | None, status: int, expected: str) -> None:
    server, url = _serve(answered, status)
    try:
        result = gateway_health(url, "s3cret")
        assert result == expected if expected is None else expected in result
        if answered is None:
            assert gateway_health(url, "") is None  # no token asked for (a stack without one): any gateway
    finally:
        server.shutdown()
        server.server_close()
    assert gateway_health(url, "s3cret") == "not listening"


def test_stack_is_not_ready_while_a_foreign_server_answers(stand_ins: ModuleType) -> None:
    """A gateway that does not know the stack's token (as any other server on the port) never makes it ready."""

    def plan(config: StackConfig, runtime: Runtime) -> list[ServiceSpec]:
        specs = stand_ins.stand_in_plan(config, runtime)
        gateway = specs[-1]
        return [*specs[:-1], ServiceSpec(gateway.name, gateway.argv, {"PYTHONUNBUFFERED": "1"})]

    stack = Stack(StackConfig(prefill=1, decode=1, port=0, ready_timeout=3), plan=plan, prepare_model=False)
    with pytest.raises(StackError, match="not ready after 3 s: waiting for gateway \\(another server answers there"):
        stack.start()
    assert all(p.poll() is not None for p in stack.processes.values())


@pytest.mark.slow
def test_the_model_is_converted_once_before_any_service_starts(stand_ins: ModuleType, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    started: list[str] = []

    def plan(config: StackConfig, runtime: Runtime) -> list[ServiceSpec]:
        started.append(f"plan, converted: {[p.name for p in (cache / 'models').iterdir()]}")
        return stand_ins.stand_in_plan(config, runtime)

    lines: list[str] = []
    config = StackConfig(prefill=1, decode=1, port=0, ready_timeout=30, env={"SPINDLE_CACHE_DIR": str(cache)})
    with Stack(config, echo=lines.append, plan=plan):
        pass
    assert lines[0].startswith("converting ") and "(once per machine)" in lines[0]
    assert lines[1].startswith("model smollm2 ready in ") and lines[2].startswith("nats-server")
    assert started == ["plan, converted: " + str([p.name for p in (cache / "models").iterdir()])]
    assert len(list((cache / "models").iterdir())) == 1

    lines.clear()  # converted: the next start goes straight on
    with Stack(config, echo=lines.append, plan=functools.partial(stand_ins.stand_in_plan)):
        pass
    assert lines[0].startswith("nats-server")


def test_unknown_model_fails_before_anything_starts() -> None:
    stack = Stack(StackConfig(model="no-such-model", port=0))
    with pytest.raises(StackError, match="unknown model 'no-such-model'"):
        stack.start()
    assert stack.processes == {}
