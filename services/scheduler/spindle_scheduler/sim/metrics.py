"""Per-request records and the summary metrics of a simulated run (TTFT, TBT/TPOT, E2E, throughput)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

TERMINAL = ("finished", "rejected", "failed")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, in virtual seconds. Token times include the prefill's first token."""

    request_id: str
    arrived_at: float
    num_prefill_tokens: int
    num_decode_tokens: int
    state: str = "pending"  # then exactly one of TERMINAL
    reason: str = ""
    prefill_instance: str = ""
    decode_instance: str = ""
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_end: float | None = None
    decode_start: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrived_at if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrived_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: np.ndarray | list[float]) -> Stats:
        arr = np.asarray(values, dtype=float)
        if arr.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), int(arr.size))


@dataclass(frozen=True)
class SimSummary:
    strategy: str
    workload: str
    rate: float | None
    num_requests: int
    completed: int
    rejected: int
    failed: int
    ttft_s: Stats
    tbt_s: Stats  # every gap between consecutive tokens of a request (inter-token latency)
    tpot_s: Stats  # per-request mean time per output token after the first
    e2e_s: Stats
    throughput_tok_s: float  # output tokens of completed requests / (last finish - first arrival)
    input_throughput_tok_s: float
    duration_s: float  # virtual seconds from the first arrival to the last terminal event

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        # NaN (no sample) is written as null so the file is strict JSON
        def clean(x: object) -> object:
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, float) and x != x:
                return None
            return x

        return json.dumps(clean(self.to_dict()), indent=indent)


def summarize(
    records: list[RequestRecord], strategy: str = "", workload: str = "", rate: float | None = None
) -> SimSummary:
    done = [r for r in records if r.state == "finished"]
    gaps = [np.diff(r.token_times) for r in done if len(r.token_times) > 1]
    ends = [r.finished_at for r in records if r.finished_at is not None]
    start = min((r.arrived_at for r in records), default=0.0)
    duration = max(ends, default=start) - start
    out_tokens = sum(len(r.token_times) for r in done)
    in_tokens = sum(r.num_prefill_tokens for r in done)
    return SimSummary(
        strategy=strategy,
        workload=workload,
        rate=rate,
        num_requests=len(records),
        completed=len(done),
        rejected=sum(r.state == "rejected" for r in records),
        failed=sum(r.state == "failed" for r in records),
        ttft_s=Stats.of([r.ttft for r in done]),
        tbt_s=Stats.of(np.concatenate(gaps) if gaps else []),
        tpot_s=Stats.of([t for r in done if (t := r.tpot) is not None]),
        e2e_s=Stats.of([r.e2e for r in done]),
        throughput_tok_s=out_tokens / duration if duration > 0 else 0.0,
        input_throughput_tok_s=in_tokens / duration if duration > 0 else 0.0,
        duration_s=duration,
    )
