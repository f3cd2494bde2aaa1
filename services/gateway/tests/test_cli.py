"""`python -m spindle_gateway` as a real process: help, readiness, serving, and a clean SIGTERM mid-stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import httpx

from .scripted_peer import ANSWER, MODEL, ScriptedPeer, start_gateway_process, wait_until


def test_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spindle_gateway", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for flag in (
        "--nats-url",
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--request-timeout",
        "--max-stop-strings",
        "--otlp-endpoint",
    ):
        assert flag in out


def test_serves_and_stops_cleanly_on_sigterm(harness: Any, peer: ScriptedPeer) -> None:
    proc, url = start_gateway_process(harness.nats.url, "--served-model-name", "spindle-test", "--log-level", "WARNING")
    try:
        body = {"model": "spindle-test", "messages": [{"role": "user", "content": "Capital of France?"}]}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == ANSWER
        assert resp.json()["model"] == "spindle-test"
        assert httpx.get(url + "/v1/models").json()["data"][0]["root"] == MODEL

        # SIGTERM while a stream is open: it ends with an error event and [DONE], the request is aborted.
        peer.script = peer.endless_script()
        peer.interval = 0.02
        events = []
        with (
            httpx.Client(timeout=10) as client,
            client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as stream,
        ):
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        request_id = json.loads(events[0])["id"]
        assert wait_until(lambda: peer.aborted(request_id), 2.0)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
