"""bench/bench_serve.py's statistics (vLLM's definitions) and SSE parsing, without a server."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from serve_client import stream_completion
from serve_stats import RequestResult, arrival_offsets, compute_metrics, summarize_ms


def _result(ttft: float, itl: list[float], tokens: int, start: float = 0.0, prompt_len: int = 10) -> RequestResult:
    return RequestResult(
        prompt_len=prompt_len,
        success=True,
        output_tokens=tokens,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
    )


def test_compute_metrics_matches_vllm_definitions() -> None:
    a = _result(0.1, [0.02, 0.04], 3, start=0.0)
    b = _result(0.3, [0.06], 2, start=0.05)
    c = _result(0.2, [], 1, start=1.0)  # one token: no TPOT
    failed = RequestResult(prompt_len=10, error="HTTP 500")
    m = compute_metrics([a, b, c, failed], duration_s=2.0)

    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # TPOT = (e2e - ttft) / (tokens - 1): a -> 0.03, b -> 0.06
    assert m["mean_tpot_ms"] == pytest.approx(45.0)
    assert m["median_tpot_ms"] == pytest.approx(45.0)
    assert m["std_tpot_ms"] == pytest.approx(15.0)  # population std, as numpy
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(40.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([20, 40, 60], 99))
    assert m["mean_e2el_ms"] == pytest.approx((160 + 360 + 200) / 3)
    assert m["max_concurrent_requests"] == 2  # a and b overlap; c starts after both ended
    assert m["output_lens"] == [3, 2, 1, 0]
    assert m["errors"] == ["", "", "", "HTTP 500"]


def test_summaries_of_nothing_are_zero_and_percentile_names() -> None:
    out = summarize_ms([], "ttft", (50, 99.9))
    assert out == {
        "mean_ttft_ms": 0.0,
        "median_ttft_ms": 0.0,
        "std_ttft_ms": 0.0,
        "p50_ttft_ms": 0.0,
        "p99.9_ttft_ms": 0.0,
    }
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0.0)


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, float("inf"), seed=0) == [0.0] * 4
    offsets = arrival_offsets(32, 4.0, seed=0)
    assert offsets == arrival_offsets(32, 4.0, seed=0)  # seeded
    assert offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(8.0)  # scaled so the last request goes at n / rate
    with pytest.raises(ValueError):
        arrival_offsets(4, 0.0, seed=0)


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _stream(body: bytes, status: int = 200) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        assert payload["stream"] and payload["ignore_eos"] and payload["temperature"] == 0.0
        assert payload["stream_options"] == {"include_usage": True}
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_completion(client, "http://x/v1/completions", "m", [1, 2, 3], 3)

    return asyncio.run(go())


def test_stream_completion_parses_sse() -> None:
    chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    r = _stream(_sse(chunk, chunk, chunk, usage, b"[DONE]"))
    assert r.success and r.error == ""
    assert (r.prompt_len, r.output_tokens, len(r.itl)) == (3, 3, 2)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))

    r = _stream(_sse(chunk, {"error": {"message": "decode died", "code": 503}}, b"[DONE]"))
    assert not r.success and "decode died" in r.error

    r = _stream(b'{"error": {"message": "bad"}}', status=400)
    assert not r.success and r.error.startswith("HTTP 400")


def test_the_load_generator_replays_mooncake_and_burstgpt_traces() -> None:
    from serve_trace import load_trace, trace_prompts

    examples = Path(__file__).resolve().parents[1] / "examples" / "traces"
    moon = load_trace(examples / "mooncake_example.jsonl")
    burst = load_trace(examples / "burstgpt_example.csv")
    assert len(moon) == 64 and len(burst) == 62
    assert moon[0].arrived_at == burst[0].arrived_at == 0.0  # BurstGPT's trace starts 5 s in: replayed from 0
    assert [len(p) for p in trace_prompts(moon[:3], seed=0)] == [r.num_prefill_tokens for r in moon[:3]]
