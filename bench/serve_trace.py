"""Trace replay for the load generator: each request of a trace file is sent at its `arrived_at` offset.

A request of the trace (`spindle_sim.traces.read_trace`: Mooncake / AIPerf JSONL, BurstGPT CSV, or Spindle's
own Vidur-style CSV / vLLM custom-dataset JSONL) becomes a
token-id prompt of exactly `num_prefill_tokens` random ids in [1000, 40000) (seeded; the completions API
takes a list of ids as `prompt`, so no tokenizer round trip changes the length) with `max_tokens =
num_decode_tokens` and `ignore_eos`, so the output length is exact too. Arrival offsets are used as they are
(no rescaling, unlike the synthetic load's `arrival_offsets`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from serve_client import run_schedule
from serve_stats import RequestResult

from spindle_sim.traces import read_trace, replay
from spindle_sim.workloads import TraceRequest


def load_trace(path: str | Path, model: str = "smollm2") -> list[TraceRequest]:
    """A trace file in any format `read_trace` reads, its requests in arrival order from 0; plain vLLM JSONL lines
    are counted with `model`'s tokenizer."""
    path = Path(path)
    trace = read_trace(path, count_tokens=_token_counter(model))
    if trace:
        trace = replay(trace, len(trace))  # arrival order, the first at 0 (a BurstGPT trace starts seconds in)
    if not trace:
        raise ValueError(f"{path}: the trace is empty")
    return trace


def _token_counter(model: str) -> Callable[[str], int]:
    tokenizer = None

    def count(text: str) -> int:  # loaded only if a line has no num_prefill_tokens
        nonlocal tokenizer
        if tokenizer is None:
            from spindle_model import Tokenizer, resolve_model

            tokenizer = Tokenizer(resolve_model(model, progress=False).path)
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def trace_prompts(trace: Sequence[TraceRequest], seed: int, low: int = 1000, high: int = 40000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(r.num_prefill_tokens)] for r in trace]


async def run_trace(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    trace: Sequence[TraceRequest],
    seed: int,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float, float]:
    """Replay `trace` against `url` (…/v1/completions): (results in trace order, duration s, perf_counter start)."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrived_at)
    prompts = trace_prompts(trace, seed)
    results, duration, start = await run_schedule(
        client,
        url,
        model,
        [prompts[i] for i in order],
        [trace[i].num_decode_tokens for i in order],
        [trace[i].arrived_at for i in order],
        on_done,
    )
    by_index: list[RequestResult | None] = [None] * len(trace)
    for i, r in zip(order, results, strict=True):
        by_index[i] = r
    return [r for r in by_index if r is not None], duration, start


def request_rows(trace: Sequence[TraceRequest], results: Sequence[RequestResult], start: float) -> list[dict[str, Any]]:
    """Per request, seconds: the trace's arrival, when it was really sent (from the run's start), TTFT and E2E
    from the send, and every content chunk's time from the send (the first is the TTFT)."""
    rows = []
    for req, r in zip(trace, results, strict=True):
        times, t = [], r.ttft
        if r.success:
            times.append(t)
            for gap in r.itl:
                t += gap
                times.append(t)
        usage = r.usage or {}
        rows.append(
            {
                "arrived_at": req.arrived_at,
                "sent_at": r.start_time - start,
                "num_prefill_tokens": req.num_prefill_tokens,
                "num_decode_tokens": req.num_decode_tokens,
                "prompt_tokens": usage.get("prompt_tokens"),
                "output_tokens": r.output_tokens if r.success else 0,
                "success": r.success,
                "ttft": r.ttft if r.success else None,
                "e2e": r.latency if r.success else None,
                "token_times": times,
                "spindle": usage.get("spindle"),  # the stack's own per-phase times (queue, prefill, transfer, decode)
                "error": r.error,
            }
        )
    return rows


def length_mismatches(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Requests whose served prompt/output length differs from the trace (the replay must be exact)."""
    bad = []
    for i, row in enumerate(rows):
        if not row["success"]:
            continue
        if row["prompt_tokens"] is not None and row["prompt_tokens"] != row["num_prefill_tokens"]:
            bad.append(f"request {i}: {row['prompt_tokens']} prompt tokens, trace says {row['num_prefill_tokens']}")
        if row["output_tokens"] != row["num_decode_tokens"]:
            bad.append(f"request {i}: {row['output_tokens']} output tokens, trace says {row['num_decode_tokens']}")
    return bad
