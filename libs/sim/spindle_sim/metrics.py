"""Per-request records and the summary metrics of a simulated run: TTFT, TBT/TPOT, E2E, throughput, goodput
under an SLO, LoongServe's normalised latencies, and the wall time of the strategy's `plan()` calls.

Service classes: a batch request (``service_class="batch"``, e.g. ``mixed-batch``'s job) has no latency SLO, so
goodput and SLO attainment count interactive requests only, and the batch job is measured by its completion time
(``batch_jct_s``). The latency statistics (``ttft_s``, ``tpot_s``, ``e2e_s``, ...) cover every completed request,
batch ones included (what the cluster did); ``interactive_ttft_s`` / ``interactive_tpot_s`` are the same over
interactive requests only (what the users with an SLO saw). A trace without batch requests gives the same
numbers either way."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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
    service_class: str = "interactive"  # or "batch": no latency SLO
    state: str = "pending"  # then exactly one of TERMINAL
    reason: str = ""
    prefill_instance: str = ""  # the first instance of the plan
    prefill_instances: tuple[str, ...] = ()  # every instance that computed part of the prompt
    max_sp: int = 0  # the largest SP group of its prefill plan
    decode_instance: str = ""
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_end: float | None = None
    decode_start: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0  # times its decode was swapped out to the kvstore
    moves: int = 0  # times it was moved, parked, to another decode instance
    predicted_ttft: float | None = None  # what the strategy's plan predicted at admission (None: no prediction)
    scale_ups: int = 0  # KV-parallel: its outputs went to a member holding none of it (the tail had no room)
    scale_downs: int = 0  # KV-parallel shards of it merged into another holder (ScaleDownKVP)

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
class PlanTimes:
    """Wall time of the strategy's `plan()` calls in a run, in microseconds (one call per request the admission
    limits let through). Measured on this machine's clock, so it varies run to run; NaN when plan() never ran."""

    mean: float
    p99: float
    max: float

    @classmethod
    def of(cls, ns: Sequence[int]) -> PlanTimes:
        """From per-call durations in nanoseconds."""
        if not len(ns):
            nan = float("nan")
            return cls(nan, nan, nan)
        us = np.asarray(ns, dtype=float) / 1e3
        return cls(float(us.mean()), float(np.percentile(us, 99)), float(us.max()))


def format_plan_us(d: dict[str, float | None]) -> str:
    """'mean 41 µs, p99 180 µs, max 950 µs' from a plan_us dict (None: no call)."""
    return ", ".join(f"{k} {'-' if d[k] is None else f'{d[k]:.0f}'} µs" for k in ("mean", "p99", "max"))


@dataclass(frozen=True)
class Slo:
    """A per-request latency objective (DistServe's, as LoongServe's goodput uses): a request meets it when it
    finished, its TTFT <= ttft_s (+ ttft_per_ktok_s per 1,000 prompt tokens: a longer prompt may take longer, as
    users of long documents expect) and its TPOT (mean time per output token after the first) <= tpot_s. A limit
    left as None is no limit; a request with a single output token has no TPOT and meets any TPOT limit."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    ttft_per_ktok_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {value}")
        if not (math.isfinite(self.ttft_per_ktok_s) and self.ttft_per_ktok_s >= 0):
            raise ValueError(f"SLO ttft_per_ktok_s must be >= 0 seconds, got {self.ttft_per_ktok_s}")
        if self.ttft_per_ktok_s and self.ttft_s is None:
            raise ValueError("an SLO's per-1K-token TTFT term needs its base TTFT limit (ttft_s)")

    def describe(self) -> str:
        """'TTFT <= 1 s + 0.05 s/1K prompt tokens, TPOT <= 0.1 s' ('' without limits)."""
        return describe_slo(asdict(self))

    def ttft_limit(self, num_prompt_tokens: int) -> float | None:
        """The TTFT limit of a request with this many prompt tokens (None: no limit)."""
        if self.ttft_s is None:
            return None
        return self.ttft_s + self.ttft_per_ktok_s * num_prompt_tokens / 1000

    def met_by(self, rec: RequestRecord) -> bool:
        if rec.state != "finished":
            return False
        ttft, tpot, limit = rec.ttft, rec.tpot, self.ttft_limit(rec.num_prefill_tokens)
        if limit is not None and (ttft is None or ttft > limit):
            return False
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def describe_slo(slo: dict[str, float | None] | None) -> str:
    """An SLO as its JSON dict (`asdict(Slo)`) in words."""
    if not slo:
        return ""
    limits = []
    if slo.get("ttft_s") is not None:
        per = slo.get("ttft_per_ktok_s") or 0.0
        limits.append(f"TTFT <= {slo['ttft_s']:g} s" + (f" + {per:g} s/1K prompt tokens" if per else ""))
    if slo.get("tpot_s") is not None:
        limits.append(f"TPOT <= {slo['tpot_s']:g} s")
    return ", ".join(limits)


def strict_json(x: object) -> object:
    """NaN (no sample) and infinities -> None, recursively, so json.dumps writes strict JSON."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


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
    # LoongServe §7.1 normalised latencies (s/token), over completed requests; the paper plots their means
    normalized_latency_s: Stats  # E2E / (prompt + output tokens)
    normalized_input_latency_s: Stats  # TTFT (the prefill phase, queueing included) / prompt tokens
    normalized_output_latency_s: Stats  # (E2E - TTFT) (the decoding phase) / output tokens
    # goodput under `slo` (None when no SLO was given), interactive requests only, per second of offered load: over
    # the interactive requests' arrival window (first to last arrival; with open-loop arrivals it is the SLO
    # attainment times the arrival rate, so a strategy that finishes its last long request later is not scored
    # lower for it), or their first arrival to last finish when they all arrive at once
    slo: Slo | None = None
    goodput_req_s: float | None = None  # completed interactive requests meeting the SLO per second
    goodput_tok_s: float | None = None  # their output tokens per second
    # interactive requests meeting the SLO / all interactive requests (rejected and failed miss it); NaN: none
    slo_attainment: float | None = None
    interactive_ttft_s: Stats = field(default_factory=lambda: Stats.of([]))  # over completed interactive requests
    interactive_tpot_s: Stats = field(default_factory=lambda: Stats.of([]))
    num_batch: int = 0  # batch requests in the trace
    # the batch job's completion time: from its first request's arrival to its last one's finish; None: no batch
    # request; inf: some batch request was rejected or failed
    batch_jct_s: float | None = None
    preemptions: int = 0  # decode swap-outs to the kvstore, all requests
    moves: int = 0  # parked requests moved to another decode instance, all requests
    scale_ups: int = 0  # KV-parallel tails moved to a member holding none of the request, all requests
    scale_downs: int = 0  # KV-parallel shards merged into another holder, all requests
    # wall time of each plan() call; not part of equality, so the same seed still gives equal summaries
    plan_us: PlanTimes = field(default_factory=lambda: PlanTimes.of([]), compare=False)
    # per kind of work: how far the strategy's forms were from its price (sim/prices.py); None: priced by them
    prediction_error: dict[str, dict[str, float | int]] | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(strict_json(self.to_dict()), indent=indent)


def _span(records: Sequence[RequestRecord]) -> float:
    """Virtual seconds from the first arrival to the last finish (0 when nothing finished)."""
    start = min((r.arrived_at for r in records), default=0.0)
    return max((r.finished_at for r in records if r.finished_at is not None), default=start) - start


def summarize(
    records: list[RequestRecord],
    strategy: str = "",
    workload: str = "",
    rate: float | None = None,
    slo: Slo | None = None,
    plan_ns: Sequence[int] = (),
) -> SimSummary:
    """The run's metrics; `plan_ns`: the wall time of each plan() call (ns), reported as `plan_us`. Goodput and
    SLO attainment count interactive requests only; latency statistics cover all completed requests (module
    docstring)."""
    done = [r for r in records if r.state == "finished"]
    gaps = [np.diff(r.token_times) for r in done if len(r.token_times) > 1]
    duration = _span(records)
    out_tokens = sum(len(r.token_times) for r in done)
    in_tokens = sum(r.num_prefill_tokens for r in done)
    with_tokens = [r for r in done if r.token_times and r.finished_at is not None]
    interactive = [r for r in records if r.service_class != "batch"]
    interactive_done = [r for r in done if r.service_class != "batch"]
    batch = [r for r in records if r.service_class == "batch"]
    goodput_req = goodput_tok = attainment = None
    if slo is not None:
        good = [r for r in interactive_done if slo.met_by(r)]
        arrivals = [r.arrived_at for r in interactive]
        span = (max(arrivals) - min(arrivals)) if len(arrivals) > 1 else 0.0
        span = span if span > 0 else _span(interactive)
        goodput_req = len(good) / span if span > 0 else 0.0
        goodput_tok = sum(len(r.token_times) for r in good) / span if span > 0 else 0.0
        attainment = len(good) / len(interactive) if interactive else float("nan")
    jct = None
    if batch:
        jct = _span(batch) if all(r.state == "finished" for r in batch) else math.inf
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
        normalized_latency_s=Stats.of([r.e2e / (r.num_prefill_tokens + len(r.token_times)) for r in with_tokens]),
        normalized_input_latency_s=Stats.of([r.ttft / r.num_prefill_tokens for r in with_tokens]),
        normalized_output_latency_s=Stats.of([(r.e2e - r.ttft) / len(r.token_times) for r in with_tokens]),
        slo=slo,
        goodput_req_s=goodput_req,
        goodput_tok_s=goodput_tok,
        slo_attainment=attainment,
        interactive_ttft_s=Stats.of([r.ttft for r in interactive_done]),
        interactive_tpot_s=Stats.of([t for r in interactive_done if (t := r.tpot) is not None]),
        num_batch=len(batch),
        batch_jct_s=jct,
        preemptions=sum(r.preemptions for r in records),
        moves=sum(r.moves for r in records),
        scale_ups=sum(r.scale_ups for r in records),
        scale_downs=sum(r.scale_downs for r in records),
        plan_us=PlanTimes.of(plan_ns),
    )
