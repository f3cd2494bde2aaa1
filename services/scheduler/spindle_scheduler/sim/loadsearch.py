"""Max sustainable load: the highest request rate at which a latency stays under its SLO (Tetris §7.2, LoongServe
§7.1: SLO = 25x the latency under light load), found by a search over rates.

- The metric is one latency percentile of a run, e.g. TTFT P50 (default), TBT P99, E2E P90.
- Light load: a caller-given rate, or the rate found by halving from ``start_rate`` until halving no longer
  lowers the metric by more than ``flat_tol`` (5 %): requests then rarely queue behind each other, and the
  latency is that of a request alone on the cluster. Every rate replays the same requests (same seed) with
  the arrival gaps scaled, so at low enough rates the metric stops changing.
- SLO = ``slo_scale`` (25) x the light-load value, unless an absolute ``slo_s`` is given.
- Search: from the light rate, multiply by ``growth`` (2) until a rate violates the SLO (or ``max_rate`` is
  passed), then bisect between the last good and the first bad rate until they are within ``rel_tol`` (5 %)
  of each other. A rate violates the SLO when its metric is above it or NaN, or when any request was
  rejected or failed (a strategy must not buy latency by dropping requests).

It assumes the metric grows with the rate (a finite trace is only roughly monotone). The trace must be long
enough for queues to build: with K requests, even all arriving at once, a TTFT can only grow about K / (number
of instances) times the light-load value, so 25x may never be reached with a short trace (``saturated`` is
then False and ``rate`` is the highest rate probed). Deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..latency import LatencyModel
from ..workloads import make_workload
from .cluster import SimConfig
from .sweep import check_metric, metric_value, run_point

Evaluate = Callable[[float], float]  # rate -> metric value (inf or NaN: the rate violates any SLO)


@dataclass(frozen=True)
class LoadPoint:
    rate: float
    value: float  # the metric at this rate (inf: requests were rejected or failed)
    ok: bool  # under the SLO


@dataclass(frozen=True)
class MaxLoad:
    strategy: str
    metric: str  # e.g. "ttft_p50"
    light_rate: float
    light_value: float
    slo_s: float
    rate: float | None  # highest rate found under the SLO; None when even the light rate violates it
    next_rate: float | None  # the lowest probed rate above `rate` that violates it; None: none up to max_rate
    points: list[LoadPoint] = field(default_factory=list)  # every evaluated rate, ascending

    @property
    def saturated(self) -> bool:
        return self.next_rate is not None


class _Cached:
    def __init__(self, evaluate: Evaluate) -> None:
        self.evaluate = evaluate
        self.values: dict[float, float] = {}

    def __call__(self, rate: float) -> float:
        if rate not in self.values:
            self.values[rate] = float(self.evaluate(rate))
        return self.values[rate]


def find_light_load(
    evaluate: Evaluate, start_rate: float = 1.0, flat_tol: float = 0.05, max_halvings: int = 12
) -> tuple[float, float]:
    """(rate, value) where halving the rate no longer lowers the metric by more than ``flat_tol``."""
    if not (math.isfinite(start_rate) and start_rate > 0):
        raise ValueError(f"start_rate must be finite and > 0, got {start_rate}")
    rate, value = start_rate, evaluate(start_rate)
    for _ in range(max_halvings):
        lower = evaluate(rate / 2)
        flat = value == value and lower >= (1 - flat_tol) * value
        rate, value = rate / 2, lower
        if flat:
            break
    return rate, value


def search_max_rate(
    evaluate: Evaluate,
    slo_s: float,
    start_rate: float,
    rel_tol: float = 0.05,
    max_rate: float = 1e4,
    growth: float = 2.0,
) -> tuple[float | None, float | None]:
    """(highest good rate, lowest bad rate probed above it) by growth from ``start_rate`` then bisection."""
    if not (rel_tol > 0 and growth > 1 and start_rate > 0 and max_rate >= start_rate):
        raise ValueError("need rel_tol > 0, growth > 1 and 0 < start_rate <= max_rate")

    def ok(rate: float) -> bool:
        return evaluate(rate) <= slo_s  # False for NaN

    if not ok(start_rate):
        return None, start_rate
    lo, hi = start_rate, None
    while hi is None and lo < max_rate:
        rate = min(lo * growth, max_rate)
        if ok(rate):
            lo = rate
        else:
            hi = rate
    if hi is None:
        return lo, None
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def search_max_load(
    evaluate: Evaluate,
    strategy: str = "",
    metric: str = "ttft_p50",
    light_rate: float | None = None,
    slo_scale: float = 25.0,
    slo_s: float | None = None,
    start_rate: float = 1.0,
    rel_tol: float = 0.05,
    max_rate: float = 1e4,
) -> MaxLoad:
    """The whole procedure on any ``evaluate`` (the simulator below, or a toy in tests)."""
    if not slo_scale > 0 or (slo_s is not None and not slo_s > 0):
        raise ValueError("slo_scale and slo_s must be > 0")
    cached = _Cached(evaluate)
    if light_rate is None:
        light_rate, light_value = find_light_load(cached, start_rate)
    else:
        if not (math.isfinite(light_rate) and light_rate > 0):
            raise ValueError(f"light_rate must be finite and > 0, got {light_rate}")
        light_value = cached(light_rate)
    slo = slo_s if slo_s is not None else slo_scale * light_value
    rate, next_rate = search_max_rate(cached, slo, light_rate, rel_tol, max(max_rate, light_rate))
    points = [LoadPoint(r, v, v <= slo) for r, v in sorted(cached.values.items())]
    return MaxLoad(strategy, metric, light_rate, light_value, slo, rate, next_rate, points)


def max_sustainable_load(
    strategy: str,
    workload: str,
    latency: LatencyModel,
    config: SimConfig,
    num_requests: int = 1000,
    seed: int = 0,
    metric: str = "ttft",
    percentile: str = "p50",
    light_rate: float | None = None,
    slo_scale: float = 25.0,
    slo_s: float | None = None,
    start_rate: float = 1.0,
    rel_tol: float = 0.05,
    max_rate: float = 1e4,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> MaxLoad:
    """Max sustainable load of ``strategy`` on ``workload`` in the simulator (see the module docstring)."""
    check_metric(metric, percentile)

    def evaluate(rate: float) -> float:
        trace = make_workload(workload, num_requests, rate, seed, arrival, cv)
        summary = run_point(trace, strategy, latency, config, workload, rate)
        if summary.completed < summary.num_requests:
            return math.inf
        return metric_value(summary, metric, percentile)

    return search_max_load(
        evaluate, strategy, f"{metric}_{percentile}", light_rate, slo_scale, slo_s, start_rate, rel_tol, max_rate
    )
