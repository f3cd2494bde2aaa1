"""Max sustainable load: the highest request rate at which a latency stays under its SLO (Tetris §7.2, LoongServe
§7.1: SLO = 25x the latency under light load), found by a search over rates.

- The metric is one latency percentile of a run, e.g. TTFT P50 (default), TBT P99, E2E P90.
- Light load: a caller-given rate, or the rate found by halving from ``start_rate`` until halving no longer
  lowers the metric by more than ``flat_tol`` (5 %): requests then rarely queue behind each other, and the
  latency is that of a request alone on the cluster. Every rate replays the same requests (same seed) with
  the arrival gaps scaled, so at low enough rates the metric stops changing.
- SLO = ``slo_scale`` (25) x the light-load value, unless an absolute ``slo_s`` is given. A comparison tells every
  strategy the same SLO (`spindle sim compare`: 25x the best strategy's light-load value), never each its own; a
  strategy whose light load already fails (it rejects requests there) has no finite SLO of its own and no max load.
- Search: from the light rate, multiply by ``growth`` (2) until a rate violates the SLO (or ``max_rate`` is
  passed), then bisect between the last good and the first bad rate until they are within ``rel_tol`` (5 %)
  of each other. A rate violates the SLO when its metric is above it or NaN, or when any request was
  rejected or failed (a strategy must not buy latency by dropping requests).

It assumes the metric grows with the rate (a finite trace is only roughly monotone). The trace must be long
enough for queues to build: with K requests, even all arriving at once, a TTFT can only grow about K / (number
of instances) times the light-load value, so 25x may never be reached with a short trace (``saturated`` is
then False and ``rate`` is the highest rate probed). Deterministic for a seed.

The attainment rule (DistServe's goodput: the highest rate at which at least a share A of requests meet a
per-request SLO; ``attainment=A`` with an ``Slo``, ``--max-load-attainment A`` with ``--slo-ttft``/``--slo-tpot``)
replaces the latency-percentile rule above: a rate is under the SLO when the run's ``slo_attainment``
(interactive requests meeting the TTFT and TPOT limits, over all interactive requests; batch requests have no
latency SLO) is >= A (an interactive request that was rejected or failed is a miss) and no batch request was rejected
or failed. The SLO is absolute, so there is no light-load
search: the search starts at ``start_rate``; when that rate already violates, it halves until one holds, at most
8 times (to ``start_rate`` / 256: requests then hardly queue, so a rate still violating there is taken to mean
the SLO is out of reach, ``rate`` None), and then grows and bisects as above. ``metric`` is then
"slo_attainment", ``light_rate`` / ``light_value`` are ``start_rate`` and its attainment, ``slo_s`` is NaN, and
``attainment`` and ``slo`` record the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spindle_policy.latency import LatencyModel

from .cluster import SimConfig
from .metrics import SimSummary, Slo
from .sweep import check_metric, metric_value, run_point
from .workloads import make_workload

Evaluate = Callable[[float], float]  # rate -> metric value (inf or NaN: the rate violates any SLO)
MAX_HALVINGS = 8  # the attainment rule's search below a violating start rate: down to start / 256


@dataclass(frozen=True)
class LoadPoint:
    rate: float
    # the metric at this rate (latency rule: inf when requests were rejected or failed; attainment rule: -inf)
    value: float
    ok: bool  # under the SLO


@dataclass(frozen=True)
class MaxLoad:
    strategy: str
    metric: str  # e.g. "ttft_p50"; "slo_attainment" under the attainment rule
    light_rate: float  # attainment rule: the rate the search started from
    light_value: float
    slo_s: float  # NaN under the attainment rule
    rate: float | None  # highest rate found under the SLO; None when even the light rate violates it
    next_rate: float | None  # the lowest probed rate above `rate` that violates it; None: none up to max_rate
    points: list[LoadPoint] = field(default_factory=list)  # every evaluated rate, ascending
    attainment: float | None = None  # the attainment rule's target share; None: the latency rule
    slo: Slo | None = None  # the attainment rule's per-request SLO

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
    return _search(lambda rate: evaluate(rate) <= slo_s, start_rate, rel_tol, max_rate, growth)  # NaN: bad


def _search(
    ok: Callable[[float], bool],
    start_rate: float,
    rel_tol: float = 0.05,
    max_rate: float = 1e4,
    growth: float = 2.0,
    max_halvings: int = 0,
) -> tuple[float | None, float | None]:
    """search_max_rate on a predicate; a violating start rate is halved up to ``max_halvings`` times first."""
    if not (rel_tol > 0 and growth > 1 and start_rate > 0 and max_rate >= start_rate):
        raise ValueError("need rel_tol > 0, growth > 1 and 0 < start_rate <= max_rate")
    hi: float | None = None
    for _ in range(max_halvings + 1):
        if ok(start_rate):
            break
        hi, start_rate = start_rate, start_rate / 2
    else:
        return None, hi
    lo = start_rate
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
    if not math.isfinite(slo):  # NaN or inf: the light load itself failed, there is nothing to hold
        points = [LoadPoint(r, v, False) for r, v in sorted(cached.values.items())]
        return MaxLoad(strategy, metric, light_rate, light_value, slo, None, light_rate, points)
    rate, next_rate = search_max_rate(cached, slo, light_rate, rel_tol, max(max_rate, light_rate))
    points = [LoadPoint(r, v, v <= slo) for r, v in sorted(cached.values.items())]
    return MaxLoad(strategy, metric, light_rate, light_value, slo, rate, next_rate, points)


def search_max_attainment(
    evaluate: Evaluate,
    attainment: float,
    strategy: str = "",
    slo: Slo | None = None,
    start_rate: float = 1.0,
    rel_tol: float = 0.05,
    max_rate: float = 1e4,
) -> MaxLoad:
    """The attainment rule on any ``evaluate`` (rate -> SLO attainment; -inf or NaN: the rate violates): the
    highest rate whose attainment is >= ``attainment``. ``slo`` is only recorded."""
    if not 0 < attainment <= 1:
        raise ValueError(f"the SLO attainment target must be in (0, 1], got {attainment}")
    if not (math.isfinite(start_rate) and start_rate > 0):
        raise ValueError(f"start_rate must be finite and > 0, got {start_rate}")
    cached = _Cached(evaluate)

    def ok(rate: float) -> bool:
        return cached(rate) >= attainment  # False for NaN

    rate, next_rate = _search(ok, start_rate, rel_tol, max(max_rate, start_rate), max_halvings=MAX_HALVINGS)
    points = [LoadPoint(r, v, v >= attainment) for r, v in sorted(cached.values.items())]
    light = cached(start_rate)
    return MaxLoad(strategy, "slo_attainment", start_rate, light, math.nan, rate, next_rate, points, attainment, slo)


@dataclass(frozen=True)
class Probe:
    """How one strategy's run at a rate is made: the workload's trace at that rate (at least `rate x min_window_s`
    requests, the same seed's), on the config sized to admit them all."""

    strategy: str
    workload: str
    latency: LatencyModel
    config: SimConfig
    num_requests: int = 1000
    seed: int = 0
    arrival: str = "poisson"
    cv: float = 1.0
    min_window_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_window_s) and self.min_window_s >= 0):
            raise ValueError(f"min_window_s must be >= 0 seconds, got {self.min_window_s}")

    def run(self, rate: float, slo: Slo | None = None) -> SimSummary:
        n = self.num_requests
        if math.isfinite(rate):
            n = max(n, math.ceil(rate * self.min_window_s))
        # a longer trace may have more requests in flight than the scheduler admits for `num_requests` (the CLI
        # sizes it so), which would reject requests
        config = self.config
        if n > self.num_requests:
            limit = max(config.scheduler.max_num_requests, n)
            config = replace(config, scheduler=replace(config.scheduler, max_num_requests=limit))
        trace = make_workload(self.workload, n, rate, self.seed, self.arrival, self.cv)
        return run_point(trace, self.strategy, self.latency, config, self.workload, rate, slo)

    def latency_at(self, metric: str, percentile: str) -> Evaluate:
        """rate -> the metric at that rate; inf when a request was rejected or failed."""
        check_metric(metric, percentile)

        def evaluate(rate: float) -> float:
            summary = self.run(rate)
            if summary.completed < summary.num_requests:
                return math.inf
            return metric_value(summary, metric, percentile)

        return evaluate


def light_load(
    probe: Probe, metric: str = "ttft", percentile: str = "p50", start_rate: float = 1.0
) -> tuple[float, float]:
    """(rate, metric value) of `probe`'s strategy under light load (`find_light_load`); the value is inf when it
    rejects requests even there."""
    return find_light_load(probe.latency_at(metric, percentile), start_rate)


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
    attainment: float | None = None,
    slo: Slo | None = None,
    min_window_s: float = 0.0,
) -> MaxLoad:
    """Max sustainable load of ``strategy`` on ``workload`` in the simulator (see the module docstring). With
    ``attainment``, the attainment rule under ``slo`` (which needs a TTFT and/or TPOT limit); the latency rule's
    arguments (metric, percentile, light_rate, slo_scale, slo_s) are then unused. ``min_window_s`` > 0: a rate's trace
    has at least ``rate x min_window_s`` requests (the same seed's), so that every probe offers its load for that
    long and a short trace's burst cannot pass for sustained load."""
    probe = Probe(strategy, workload, latency, config, num_requests, seed, arrival, cv, min_window_s)
    if attainment is not None:
        if slo is None or (slo.ttft_s is None and slo.tpot_s is None):
            raise ValueError("the SLO-attainment rule needs a per-request SLO: a TTFT and/or TPOT limit")

        def attained(rate: float) -> float:
            summary = probe.run(rate, slo)
            if summary.slo_attainment is None or summary.batch_jct_s == math.inf:
                return -math.inf  # a batch request was rejected or failed
            return summary.slo_attainment  # interactive requests rejected or failed count as misses

        return search_max_attainment(attained, attainment, strategy, slo, start_rate, rel_tol, max_rate)
    return search_max_load(
        probe.latency_at(metric, percentile), strategy, f"{metric}_{percentile}", light_rate, slo_scale, slo_s,
        start_rate, rel_tol, max_rate,
    )  # fmt: skip
