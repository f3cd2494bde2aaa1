"""Rate sweeps: several strategies over several request rates on one workload, the papers' load curves.

Each rate gets one trace, ``make_workload(workload, num_requests, rate, seed)``, replayed against every
strategy. With one seed the traces of all rates hold the same requests (the length draws do not depend on the
rate) and their arrival times are the same gaps scaled by 1/rate: what Tetris does when it "scales the request
arrival timestamps" to vary the load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from spindle_policy.latency import LatencyModel

from .cluster import SimConfig
from .executor import simulate
from .metrics import SimSummary, Slo, strict_json, summarize
from .workloads import TraceRequest, make_workload

METRICS = ("ttft", "tbt", "tpot", "e2e", "normalized", "normalized_input", "normalized_output")
# LoongServe's normalised latencies (per token: E2E / (input + output), prefill time / input, decode / output)
_FIELDS = {m: f"{m}_latency_s" for m in METRICS if m.startswith("normalized")}
PERCENTILES = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True)
class SweepRow:
    strategy: str  # the spec as given, e.g. "fixed-sp:sp=8"
    rate: float
    summary: SimSummary


def check_metric(metric: str, percentile: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if percentile not in PERCENTILES:
        raise ValueError(f"percentile must be one of {PERCENTILES}, got {percentile!r}")


def metric_value(summary: SimSummary, metric: str = "ttft", percentile: str = "p50") -> float:
    """``summary.<metric>_s.<percentile>``, e.g. ("ttft", "p50"); NaN when no request completed."""
    check_metric(metric, percentile)
    return float(getattr(getattr(summary, _FIELDS.get(metric, f"{metric}_s")), percentile))


def check_rates(rates: Sequence[float]) -> list[float]:
    if not rates:
        raise ValueError("need at least one rate")
    out = [float(r) for r in rates]
    if any(not (math.isfinite(r) and r > 0) for r in out):
        raise ValueError(f"rates must be finite and > 0 requests/s, got {out}")
    return out


def run_point(
    trace: Sequence[TraceRequest],
    strategy: str,
    latency: LatencyModel,
    config: SimConfig,
    workload: str,
    rate: float,
    slo: Slo | None = None,
) -> SimSummary:
    result = simulate(trace, strategy, latency, config)
    return summarize(result.records, strategy, workload, rate, slo, result.plan_ns)


def sweep(
    strategies: Sequence[str],
    rates: Sequence[float],
    workload: str,
    latency: LatencyModel,
    config: SimConfig,
    num_requests: int = 1000,
    seed: int = 0,
    slo: Slo | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> list[SweepRow]:
    """Rows in (strategy, rate) order: strategies as given, rates ascending. Deterministic for a seed."""
    if not strategies:
        raise ValueError("need at least one strategy")
    rates = sorted(check_rates(rates))
    rows: dict[tuple[str, float], SweepRow] = {}
    for rate in rates:
        trace = make_workload(workload, num_requests, rate, seed, arrival, cv)
        for spec in strategies:
            rows[spec, rate] = SweepRow(spec, rate, run_point(trace, spec, latency, config, workload, rate, slo))
    return [rows[spec, rate] for spec in strategies for rate in rates]


def rows_to_dicts(rows: Sequence[SweepRow]) -> list[dict]:
    return [strict_json(asdict(row.summary)) for row in rows]  # type: ignore[misc]


def format_table(rows: Sequence[SweepRow]) -> str:
    """A fixed-width table: strategy x rate with completed, TTFT/TBT P50/P99 and goodput."""
    head = ["strategy", "rate", "done", "ttft p50", "ttft p99", "tbt p50", "tbt p99", "goodput req/s", "slo %"]
    lines = []
    for row in rows:
        s = row.summary
        lines.append(
            [
                row.strategy,
                f"{row.rate:g}",
                f"{s.completed}/{s.num_requests}",
                *(_num(v) for v in (s.ttft_s.p50, s.ttft_s.p99, s.tbt_s.p50, s.tbt_s.p99)),
                "-" if s.goodput_req_s is None else f"{s.goodput_req_s:.3f}",
                "-" if s.slo_attainment is None else _num(100 * s.slo_attainment, 1),
            ]
        )
    widths = [max(len(c[i]) for c in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*c) for c in [head, *lines])


def _num(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:.{digits}f}"
