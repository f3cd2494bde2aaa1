"""The load generator of `bench_serve.py`: token-id prompts streamed from POST /v1/completions over SSE.

Timing follows `vllm bench serve`'s OpenAI completions client: every SSE event with a non-empty `choices`
list is a content chunk (its timestamp is taken when the event is parsed); the `choices: []` usage event
and `[DONE]` are not.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from serve_stats import RequestResult, arrival_offsets


def random_token_prompts(n: int, length: int, seed: int, low: int = 1000, high: int = 40000) -> list[list[int]]:
    """`n` prompts of `length` ids drawn uniformly from [low, high) (ordinary tokens of SmolLM2's vocabulary)."""
    if n < 1 or length < 1:
        raise ValueError(f"need n >= 1 and length >= 1, got {n}, {length}")
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """One connection pool for the whole run, unlimited connections, no proxies from the environment."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False)


def completion_payload(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    """POST one streaming completion to `url` (…/v1/completions) and time its content chunks."""
    result = RequestResult(prompt_len=len(prompt))
    chunks = 0
    st = time.perf_counter()
    result.start_time = last = st
    try:
        async with client.stream("POST", url, json=completion_payload(model, prompt, max_tokens)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:500]}"
                    return result
                if event.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                elif event.get("usage"):
                    result.usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if chunks == 0:
        result.error = "no content chunk received"
        return result
    result.success = True
    result.latency = last - st
    completion = (result.usage or {}).get("completion_tokens")
    result.output_tokens = completion if isinstance(completion, int) else chunks
    return result


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    request_rate: float,
    seed: int,
    burstiness: float = 1.0,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float]:
    """Send `prompts` at Poisson arrival times; (results in prompt order, seconds from the start to the last end)."""
    offsets = arrival_offsets(len(prompts), request_rate, seed, burstiness)
    results, duration, _ = await run_schedule(
        client, url, model, prompts, [max_tokens] * len(prompts), offsets, on_done
    )
    return results, duration


async def run_schedule(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    max_tokens: Sequence[int],
    offsets: Sequence[float],
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float, float]:
    """Send prompt i with `max_tokens[i]` at `offsets[i]` s (non-decreasing) after the start; (results in order,
    seconds from the start to the last end, the start's `time.perf_counter()`)."""
    if not len(prompts) == len(max_tokens) == len(offsets):
        raise ValueError("prompts, max_tokens and offsets must have the same length")
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError("offsets must be non-decreasing")

    async def one(prompt: list[int], n: int) -> RequestResult:
        result = await stream_completion(client, url, model, prompt, n)
        on_done(result)
        return result

    tasks = []
    start = time.perf_counter()
    for prompt, n, offset in zip(prompts, max_tokens, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(prompt, n)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, start
