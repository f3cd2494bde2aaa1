"""A bounded load test of request hygiene: `python -m spindle_gateway` as a real process (its RSS read from /proc)
in front of the SCRIPTED NATS PEER. Oversized bodies and over-long prompts, eight at once, leave the gateway's
memory near its idle level while ordinary requests keep being answered."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from .scripted_peer import ANSWER, MODEL, ScriptedPeer, start_gateway_process

MB = 1 << 20
RSS_BUDGET = 200 * MB


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class PeakRSS:
    """Samples a process's RSS every few milliseconds in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@contextlib.contextmanager
def gateway_process(nats_url: str) -> Iterator[tuple[str, int]]:
    proc, url = start_gateway_process(nats_url, "--log-level", "WARNING")
    try:
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chunks(data: bytes, size: int = 64 << 10) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}


def test_eight_ten_megabyte_bodies_leave_the_gateway_small(harness: Any, peer: ScriptedPeer) -> None:
    # 10 MB of text in a valid chat body: without the limits, each would be tokenized (seconds, ~1 GB each).
    text = "All work and no play makes Jack a dull boy. " * (10 * MB // 44)
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
    # Just under the 4 MiB default limit: read and parsed, then refused by the context bound, untokenized.
    long_prompt = json.dumps({"model": MODEL, "prompt": text[: 4 * MB - 100]}).encode()
    headers = {"content-type": "application/json"}
    with gateway_process(harness.nats.url) as (url, pid), httpx.Client(timeout=60) as client:
        for _ in range(3):  # warm every path once: a completion, a 413, a context 400
            assert client.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
            assert client.post(url + "/v1/chat/completions", content=huge[: 5 * MB], headers=headers).status_code == 413
            assert client.post(url + "/v1/completions", content=long_prompt, headers=headers).status_code == 400
        time.sleep(0.5)
        idle = rss(pid)
        sampler = PeakRSS(pid)
        done = threading.Event()
        normal: list[tuple[int, str, float]] = []

        def ordinary_requests() -> None:
            with httpx.Client(timeout=30) as c:
                while not done.is_set():
                    t0 = time.monotonic()
                    r = c.post(url + "/v1/chat/completions", json=CHAT)
                    content = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
                    normal.append((r.status_code, content, time.monotonic() - t0))

        def oversized(i: int) -> tuple[int, float]:
            t0 = time.monotonic()
            with httpx.Client(timeout=60) as c:
                if i % 3 == 0:
                    r = c.post(url + "/v1/chat/completions", content=huge, headers=headers)
                elif i % 3 == 1:
                    r = c.post(url + "/v1/chat/completions", content=chunks(huge), headers=headers)
                else:
                    r = c.post(url + "/v1/completions", content=long_prompt, headers=headers)
            assert r.headers["content-type"] == "application/json" and r.json()["error"]["code"] == r.status_code
            return r.status_code, time.monotonic() - t0

        background = threading.Thread(target=ordinary_requests)
        background.start()
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(oversized, range(24)))  # three rounds of eight at once
        flood_s = time.monotonic() - t0
        done.set()
        background.join()
        peak = sampler.stop()
        after = rss(pid)

    statuses = sorted({s for s, _ in results})
    report = {
        "idle_rss_mb": round(idle / MB, 1),
        "peak_rss_mb": round(peak / MB, 1),
        "growth_mb": round((peak - idle) / MB, 1),
        "rss_after_mb": round(after / MB, 1),
        "oversized_requests": len(results),
        "statuses": statuses,
        "slowest_rejection_s": round(max(t for _, t in results), 3),
        "flood_s": round(flood_s, 2),
        "ordinary_requests": len(normal),
        "slowest_ordinary_s": round(max(t for *_, t in normal), 3),
    }
    print("load:", json.dumps(report))
    assert statuses == [400, 413], results
    assert normal and all(s == 200 and c == ANSWER for s, c, _ in normal), normal
    assert peak - idle < RSS_BUDGET, report
