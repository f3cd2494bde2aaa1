"""End to end under pressure: a decode pool too small (KV parks in the kvstore), and workers SIGKILLed."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time

import httpx
import pytest

from .conftest import engine_greedy, instance_blocks, start_stack, wait_until
from .sse import read_events, stream_text

pytestmark = pytest.mark.slow


def test_full_decode_instance_parks_kv_in_the_kvstore(tmp_path_factory, reference_engine, tokenizer):
    # 16 blocks of 16 tokens on the decode instance: one ~150-token request at a time.
    stack = start_stack(
        tmp_path_factory,
        "tiny-decode",
        prefill=2,
        decode=1,
        max_model_len=256,
        kv_cache_tokens=1024,
        decode_kv_cache_tokens=256,
    )
    try:
        words = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)
        prompts = [words[i : i + 150] for i in range(3)]

        def one(ids: list[int]) -> dict:
            r = httpx.post(
                stack.base_url + "/completions",
                timeout=120,
                json={"model": "smollm2", "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()

        with cf.ThreadPoolExecutor(3) as pool:
            bodies = list(pool.map(one, prompts))
        expected = engine_greedy(reference_engine, prompts, 40)
        for body, ref in zip(bodies, expected, strict=True):
            assert body["choices"][0]["text"] == tokenizer.decode(ref)
        assert sum(b["usage"].get("spindle", {}).get("parked", 0) for b in bodies) >= 1, [b["usage"] for b in bodies]
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 2), instance_blocks(stack)
    finally:
        stack.stop()


def test_worker_sigkill_ends_requests_cleanly(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "kill", prefill=2, decode=1)
    try:
        # -- a prefill instance dies under a long prompt: its prefill runs again on the other one, nothing leaks --
        result: dict = {}

        def long_prefill() -> None:
            r = httpx.post(
                stack.base_url + "/completions",
                timeout=120,
                json={"model": "smollm2", "prompt": [500 + i % 3000 for i in range(3900)], "max_tokens": 4},
            )
            result["status"], result["body"] = r.status_code, r.json()

        t = threading.Thread(target=long_prefill)
        t.start()
        holder = wait_until(
            lambda: next((i for i, reqs in instance_blocks(stack).items() if i.startswith("prefill") and reqs), None),
            30,
        )
        assert holder, "no prefill instance took the request"
        stack.processes[holder].send_signal(signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the client hung"
        assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 4, result
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 3), instance_blocks(stack)
        # the other prefill instance still serves
        ok = httpx.post(
            stack.base_url + "/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4}
        )
        assert ok.status_code == 200, ok.text

        # -- the decode instance dies mid-stream: a terminal error event before the deadline, /health 503 --
        with httpx.stream(
            "POST",
            stack.base_url + "/completions",
            timeout=60,
            json={
                "model": "smollm2",
                "prompt": "Count to a thousand",
                "max_tokens": 3000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        ) as resp:
            lines = resp.iter_lines()  # kept open: leaving a for-loop over it would close the response
            while not next(lines).startswith("data: "):
                pass
            events, elapsed = kill_mid_stream(stack, "decode-0", lines)
        assert elapsed < 10
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert stream_text([e for e in events if e == "[DONE]" or "error" not in e], chat=False) is not None
        assert wait_until(lambda: httpx.get(stack.url + "/health", timeout=5).status_code == 503, 5)
    finally:
        stack.stop()


def read_events_from(lines) -> list:
    class _R:
        def iter_lines(self):
            return lines

    return read_events(_R())


def kill_member_mid_stream(stack, member: str, leader: str) -> float:
    """SIGKILL `member` of a multi-process instance (a TP follower, a pipeline stage) while a long greedy stream
    runs on it: the stream ends with an error event, and `leader` exits non-zero. Returns the seconds from the kill to
    the stream's end."""
    body = {"model": "smollm2", "prompt": "Count to a thousand", "max_tokens": 3000, "ignore_eos": True}
    with httpx.stream(
        "POST", stack.base_url + "/completions", timeout=60, json={**body, "temperature": 0, "stream": True}
    ) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        events, elapsed = kill_mid_stream(stack, member, lines)
    assert elapsed < 30
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    process = stack.processes[leader]
    assert wait_until(lambda: process.poll() is not None, 15), f"{leader} kept running without {member}"
    assert process.returncode != 0
    return elapsed


def kill_mid_stream(stack, name: str, lines) -> tuple[list, float]:
    """SIGKILL service `name` while a stream is open: the rest of the stream's events and the seconds until its
    end."""
    t0 = time.monotonic()
    stack.processes[name].send_signal(signal.SIGKILL)
    events = read_events_from(lines)
    return events, time.monotonic() - t0
