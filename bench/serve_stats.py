"""The statistics of `bench_serve.py`, computed the way `vllm bench serve` computes them (pure, no I/O).

Per request: TTFT = time to the first content chunk; ITLs = gaps between consecutive content chunks;
E2E latency = time to the last content chunk; TPOT = (E2E - TTFT) / (output tokens - 1), only for requests
with more than one output token. Summaries: mean, median, population std and percentiles (numpy's linear
interpolation), in milliseconds, under the names `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)


@dataclass
class RequestResult:
    """One streamed request as the client saw it (seconds from `time.perf_counter()`)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # request sent -> last content chunk
    start_time: float = 0.0
    error: str = ""
    usage: dict[str, Any] | None = None


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def summarize_ms(values_s: Sequence[float], name: str, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """mean/median/std/percentiles of `values_s` (seconds) in ms, keyed like `mean_{name}_ms`; zeros when empty."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1e3
    out = {
        f"mean_{name}_ms": float(np.mean(data)),
        f"median_{name}_ms": float(np.median(data)),
        f"std_{name}_ms": float(np.std(data)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p))
    return out


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, or None for a request with fewer than two output tokens."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, over half-open intervals [start, start + latency)."""
    events = [(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results]
    events.sort()  # at equal times the departure (-1) sorts first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def compute_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """The result dict of `vllm bench serve` for these requests, run in `duration_s` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    out |= summarize_ms([r.ttft for r in ok], "ttft", percentiles)
    out |= summarize_ms(tpots, "tpot", percentiles)
    out |= summarize_ms([x for r in ok for x in r.itl], "itl", percentiles)
    out |= summarize_ms([r.latency for r in ok], "e2el", percentiles)
    out |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "errors": [r.error for r in results],
    }
    return out


def arrival_offsets(n: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """When each of `n` requests is sent, in seconds from the start: Poisson at `request_rate` (gamma intervals
    for burstiness != 1), scaled so that the last one is sent at n / rate, as vLLM does; all zeros for inf."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    offsets *= (n / request_rate) / offsets[-1]
    return [float(x) for x in offsets]
