"""The gateway tokenizes without torch: its modules, its model loading and the running `python -m spindle_gateway`
import none of it; the stack token comes back on /health; an unconverted GGUF is converted as a fallback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from spindle_gateway.model_files import load_model_files
from spindle_protocol.nats_server import NatsServer
from spindle_tokenizer import Tokenizer, locate_model

from .scripted_peer import MODEL, free_port, wait_until

HEAVY = ("torch", "transformers", "numpy", "spindle_model")


def test_gateway_modules_and_model_loading_import_no_torch(tokenizer: Tokenizer) -> None:
    # The `tokenizer` fixture made sure the model is converted in this session's cache.
    code = f"""
import sys
import spindle_gateway.state, spindle_gateway.app, spindle_gateway.__main__
from spindle_gateway.model_files import load_model_files
model = load_model_files({MODEL!r})
assert model.tokenizer.encode("Hello") and model.max_position_embeddings == 8192 and model.vocab_size == 49152
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _rss_kib(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1])


def test_running_gateway_has_no_torch_and_sends_the_stack_token(tokenizer: Tokenizer, nats_server: NatsServer) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPINDLE_PARENT_PID": "0", "SPINDLE_STACK_TOKEN": "0123abcd"}
    cmd = [sys.executable, "-m", "spindle_gateway", "--nats-url", nats_server.url, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--log-level", "WARNING"], env=env)
    try:

        def listening() -> bool:
            assert proc.poll() is None
            try:
                httpx.get(url + "/health", timeout=2)
                return True
            except httpx.TransportError:
                return False

        assert wait_until(listening, 60, 0.1)
        health = httpx.get(url + "/health", timeout=5)  # 503 here (no scheduler): the token comes all the same
        assert health.headers["x-spindle-stack"] == "0123abcd"
        assert "x-spindle-stack" not in httpx.get(url + "/v1/models", timeout=5).headers
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        print(f"\n[gateway] idle RSS with the tokenizer loaded: {_rss_kib(proc.pid) / 1024:.0f} MiB")
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.slow
def test_unconverted_gguf_is_converted_as_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    assert not locate_model(MODEL).ready
    with caplog.at_level(logging.WARNING, logger="spindle.gateway"):
        model = load_model_files(MODEL)
    assert "is not converted yet" in caplog.text
    assert locate_model(MODEL).ready and model.tokenizer.path == locate_model(MODEL).path
