"""Synthetic workloads: seeded arrival processes and the papers' length distributions.

All lengths are synthesised from ``shared/reference/paper_figures.json``; the papers publish summary statistics,
not traces, so every workload is a parametric fit. The fitted family is a lognormal (LLM prompt/output lengths
are right-skewed and positive) restricted to a support ``[lo, hi]``, either *truncated* (out-of-range draws are
redrawn) or *clipped* (out-of-range draws are moved to the bound). How each workload is fitted:

- ``tetris-{short,medium,long}`` (Tetris §7.1; min/max/mean of prompt+output): sigma puts min and max at the
  0.1 %/99.9 % quantiles, mu is solved so the *truncated* mean equals the reported mean. Tetris reports no
  output lengths: the output is drawn from ``LONG_CONTEXT_DECODE`` and subtracted from the total.
- ``loongserve-{sharegpt,l-eval,lv-eval}`` (LoongServe §7.1; only min/max reported, taken as prompt lengths):
  lognormal centred (median) at the geometric midpoint with min/max at the 0.1 %/99.9 % quantiles, truncated.
  No mean/median is reported, so these are shape assumptions. Outputs are not reported: ShareGPT uses
  ``SHORT_DECODE`` and the long sets ``LONG_CONTEXT_DECODE``. ``loongserve-mixed`` samples the three with equal
  probability (as the paper says).
- ``loongserve-zipf-{1.0,1.2,1.4}`` (LoongServe §7.4 ablation, "Mixed with Zipf parameters, capped at 200K"):
  our reading is a Zipf law over 1K-token length buckets of (0, 200K]: P(bucket k) ∝ k^-alpha, uniform within
  the bucket. The paper does not define it further. ``loongserve-zipf:ALPHA`` takes any alpha.
- ``medha-sharegpt4`` (ShareGPT4 capped at 8K): the paper gives only the cap; prompt median 1024/p99 6144 and
  output median 256/p99 1536 are assumptions, prompt+output <= 8192. ``medha-long`` is Medha-SWE (prefill
  P50 393K/P90 839K, decode P50 518/P90 808) truncated to the paper's 128K–1M range with the quantiles fitted
  to the *truncated* distribution (the fit is nearly log-uniform over 128K–1M: sigma ~4.1, which is what
  P50/P90 imply inside that range). ``medha-mix`` = ShareGPT4 + 5 % long; ``medha-mix:SHARE`` or
  ``medha_mix(share)`` for other shares. ``medha-2m:SHARE``: the same with SHARE of 2M-token prompts (§5.4's 3D
  runs).
- ``csps-{needlebench,bookcorpus}`` (CSPS Table 2; median/p99/std of input and output): lognormal through the
  median and p99, clipped at 1M tokens (the paper's largest inputs; BookCorpus reports no max). A lognormal
  cannot also match the reported std (NeedleBench input std 506K vs ~200K for the fit; BookCorpus 183K vs
  ~80K): the real inputs have a heavier upper tail than any median/p99-matched lognormal.
- ``seesaw-arxiv`` (Seesaw §6.1 arxiv-summarization, statistics of the Vidur trace it uses: prompt mean 2588 /
  P50 2730 / P99 3934, output mean 291 / P50 167 / P99 3273). The prompts are left-skewed (mean < median),
  which no lognormal can produce: a Beta on [1, 4096] (the Llama-2 context the trace is filtered to) is fitted
  to mean and median; its P99 lands at ~4060 (+3 %). The outputs have a light body and a far tail that one
  lognormal cannot match together (through P50/P99 its mean is 425, not 291): a lognormal body plus a uniform
  2K–4K tail whose share puts exactly 1 % above P99; the body then matches mean and median in closed form.
  Prompt and output are drawn independently. Seesaw's ShareGPT sample is only shown as a plot (Figure 9), so it
  has no workload of its own here (``loongserve-sharegpt`` / ``medha-sharegpt4`` are the ShareGPT fits).
- ``constant:PREFILL:DECODE`` (e.g. Seesaw's 3000-token inputs, §6.5): fixed lengths.

Mixed workloads: production-like traffic, not a paper's; for stress and strategy comparisons. Every one mixes a
chat body with a few long documents, because that mix is where the strategies differ (one long prompt holds up
the chat requests queued behind it).

- ``mixed-chat`` / ``mixed-chat:SHARE``: ``medha-sharegpt4`` chat (prompt median 1K / P99 6K, output median
  256 / P99 1.5K, <= 8K in all) with SHARE (default 0.02) long documents: prompts lognormal over 16K–256K
  (``LogNormal.from_range``: median 64K, 16K/256K at the 0.1 %/99.9 % quantiles, truncated), outputs
  ``LONG_CONTEXT_DECODE``. The chat body is Medha's ShareGPT4 fit rather than LoongServe's ShareGPT range because
  Medha uses it for exactly this chat + long-document mix, its prompts (median 1K) look like today's multi-turn
  chat with system prompts and history, where the LoongServe fit (the geometric midpoint of 4–2300: median ~100)
  is a shape read off min/max only, and its 8K cap leaves a clean gap below the 16K documents, so every request
  is plainly one or the other. Bursty traffic needs no workload of its own: ``--arrival gamma --cv 4`` with
  ``mixed-chat`` is the bursty scenario (arrivals are independent of the lengths).
- ``mixed-diurnal`` / ``mixed-diurnal:LO:HI``: the same two parts, with the long share drifting over the trace
  from LO (default 0.01) to HI (default 0.20) on a raised cosine over the request index i of n (arrival order,
  which is time order): share(i) = LO + (HI - LO) (1 - cos(pi i / (n - 1))) / 2, flat at both ends like the
  ramp from a night trough to a day peak. Request i is long with probability share(i) (``DriftingMixture``). It
  drifts over requests, not seconds: with a constant-rate process the two agree up to arrival noise. HI < LO
  drifts down.
- ``mixed-batch`` / ``mixed-batch:SHARE``: online ``mixed-chat`` traffic plus one batch job (``BatchJob``) of
  round(SHARE n) of the n requests (default SHARE 0.1), ``service_class="batch"``, all submitted at once at the
  midpoint of the online requests' arrival span (between the first and the last online arrival), as an offline
  job (a Batch API file) lands in the middle of live traffic. Batch requests are document-style: prompts
  lognormal over 8K–64K (``from_range``, median 23K), outputs lognormal with median 256 and P99 1024, clipped to
  1..2048 (summaries and extractions are short). The online requests are exactly ``mixed-chat``'s trace of
  n - round(SHARE n) requests for the same seed and arrivals (times and lengths).

Arrivals: Poisson (exponential gaps, mean 1/rate) or Gamma gaps with the given coefficient of variation
(shape 1/cv^2, mean 1/rate; cv=1 is Poisson, cv>1 burstier). The first request arrives after one gap.
``rate=inf`` puts every arrival at t=0 (a batch job too). Arrival times and lengths use independent child seeds,
so changing the arrival process does not change the lengths.

Service classes: every request is ``"interactive"`` (latency SLOs apply) unless a workload says ``"batch"``
(throughput work with no latency SLO: only ``mixed-batch``'s job); the simulator passes it to the scheduler as
``RequestSpec.service_class``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Protocol

import numpy as np

from .traces import TraceRequest, read_trace, replay

_N = NormalDist()
_Z999 = _N.inv_cdf(0.999)


@dataclass(frozen=True)
class Arrival:
    kind: str = "poisson"
    rate: float = 1.0
    cv: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be 'poisson' or 'gamma', got {self.kind!r}")
        if math.isnan(self.rate) or self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if not (math.isfinite(self.cv) and self.cv > 0):
            raise ValueError(f"cv must be finite and > 0, got {self.cv}")

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if math.isinf(self.rate):
            return np.zeros(n)
        if self.kind == "poisson":
            return rng.exponential(1.0 / self.rate, n)
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, 1.0 / (self.rate * shape), n)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(self.gaps(n, rng))


class LengthDist(Protocol):
    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


class Workload(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class LogNormal:
    """Lognormal(mu, sigma) token counts on [lo, hi]; out-of-range draws are redrawn, or clipped if ``clip``."""

    mu: float
    sigma: float
    lo: int
    hi: int
    clip: bool = False

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and 1 <= self.lo < self.hi):
            raise ValueError(f"bad lognormal: sigma={self.sigma} lo={self.lo} hi={self.hi}")

    @classmethod
    def from_range(cls, lo: int, hi: int) -> LogNormal:
        return cls((math.log(lo) + math.log(hi)) / 2, math.log(hi / lo) / (2 * _Z999), lo, hi)

    @classmethod
    def from_range_mean(cls, lo: int, hi: int, mean: float) -> LogNormal:
        if not lo < mean < hi:
            raise ValueError(f"mean {mean} outside ({lo}, {hi})")
        sigma = math.log(hi / lo) / (2 * _Z999)
        a, b = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
        for _ in range(200):  # truncated mean is increasing in mu
            mid = (a + b) / 2
            a, b = (mid, b) if cls(mid, sigma, lo, hi).mean() < mean else (a, mid)
        return cls((a + b) / 2, sigma, lo, hi)

    @classmethod
    def from_quantiles(
        cls, q1: float, p1: float, q2: float, p2: float, lo: int, hi: int, clip: bool = False
    ) -> LogNormal:
        """Match quantiles q1 (level p1) and q2 (level p2) of the restricted distribution."""
        l1, l2 = p1, p2
        for _ in range(500):  # fixed point: untruncated levels that become p1/p2 after truncation
            z1, z2 = _N.inv_cdf(l1), _N.inv_cdf(l2)
            sigma = (math.log(q2) - math.log(q1)) / (z2 - z1)
            mu = math.log(q1) - sigma * z1
            if clip:
                break
            a, b = _N.cdf((math.log(lo) - mu) / sigma), _N.cdf((math.log(hi) - mu) / sigma)
            new = (a + p1 * (b - a), a + p2 * (b - a))
            if max(abs(new[0] - l1), abs(new[1] - l2)) < 1e-12:
                break
            l1, l2 = new
        return cls(mu, sigma, lo, hi, clip)

    def mean(self) -> float:
        """Analytic mean of the truncated distribution (clipping is not modelled)."""
        s, la, lb = self.sigma, math.log(self.lo), math.log(self.hi)
        za, zb = (la - self.mu) / s, (lb - self.mu) / s
        mass = _N.cdf(zb) - _N.cdf(za)
        return math.exp(self.mu + s * s / 2) * (_N.cdf(zb - s) - _N.cdf(za - s)) / mass

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.clip:
            x = rng.lognormal(self.mu, self.sigma, n)
        else:
            parts, have = [], 0
            while have < n:
                y = rng.lognormal(self.mu, self.sigma, max(2 * (n - have), 16))
                y = y[(y >= self.lo) & (y <= self.hi)]
                parts.append(y)
                have += len(y)
            x = np.concatenate(parts)[:n] if parts else np.empty(0)
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, n)


@dataclass(frozen=True)
class ScaledBeta:
    """``hi * Beta(a, b)`` rounded to tokens in [1, hi]; fits bounded, left-skewed lengths."""

    a: float
    b: float
    hi: int

    def __post_init__(self) -> None:
        if not (self.a > 0 and self.b > 0 and self.hi > 1):
            raise ValueError(f"bad beta: a={self.a} b={self.b} hi={self.hi}")

    @classmethod
    def from_mean_median(cls, mean: float, median: float, hi: int) -> ScaledBeta:
        """Shape with the given mean and median, both a, b >= 1 (unimodal, bounded density)."""
        m = mean / hi
        lo_a, hi_a = max(1.0, m / (1 - m)), 1000.0
        if not 0 < m < 1 or not cls(lo_a, lo_a * (1 - m) / m, hi).quantile(0.5) >= median >= mean:
            raise ValueError(f"no beta with a, b >= 1 has mean {mean} and median {median} on [0, {hi}]")
        for _ in range(100):  # with the mean fixed, the median falls towards it as a grows
            mid = (lo_a + hi_a) / 2
            lo_a, hi_a = (mid, hi_a) if cls(mid, mid * (1 - m) / m, hi).quantile(0.5) > median else (lo_a, mid)
        return cls(lo_a, lo_a * (1 - m) / m, hi)

    def quantile(self, p: float) -> float:
        x = (np.arange(200_000) + 0.5) / 200_000  # midpoint rule on the density
        cdf = np.cumsum(x ** (self.a - 1) * (1 - x) ** (self.b - 1))
        return float(x[np.searchsorted(cdf, p * cdf[-1])] * self.hi)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.clip(np.rint(rng.beta(self.a, self.b, n) * self.hi), 1, self.hi).astype(np.int64)


@dataclass(frozen=True)
class LengthMixture:
    parts: tuple[LengthDist, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.weights) or not self.parts or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"bad mixture weights {self.weights}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        which = rng.choice(len(self.parts), size=n, p=w / w.sum())
        out = np.zeros(n, dtype=np.int64)
        for i, part in enumerate(self.parts):
            mask = which == i
            out[mask] = part.draw(int(mask.sum()), rng)
        return out


def lognormal_with_tail(mean: float, p50: float, p99: float, tail_lo: int, hi: int) -> LengthMixture:
    """A lognormal body plus a Uniform[tail_lo, hi] tail matching mean, P50 and P99 (P99 must be in the tail).

    The tail share w puts 1 % of the mass above P99 (the body's share there is negligible); the body's median
    sits at level 0.5 / (1 - w) and its mean is what the tail leaves, which fixes sigma and mu in closed form.
    """
    if not (tail_lo < p99 < hi and p50 < mean):
        raise ValueError(f"need p50 < mean and tail_lo < p99 < hi, got {p50}, {mean}, {tail_lo}, {p99}, {hi}")
    w = 0.01 * (hi - tail_lo) / (hi - p99)
    body_mean = (mean - w * (tail_lo + hi) / 2) / (1 - w)
    if not (0 < w < 0.5 and body_mean > p50):
        raise ValueError(f"tail [{tail_lo}, {hi}] cannot carry P99 {p99} with mean {mean}")
    z = _N.inv_cdf(0.5 / (1 - w))
    sigma = z + math.sqrt(z * z + 2 * math.log(body_mean / p50))  # body: exp(mu + s^2/2) = mean, exp(mu + s z) = p50
    body = LogNormal(math.log(p50) - sigma * z, sigma, 1, hi, clip=True)
    return LengthMixture((body, Uniform(tail_lo, hi)), (1 - w, w))


@dataclass(frozen=True)
class ZipfBuckets:
    """P(bucket k) ∝ k^-alpha over buckets of ``width`` tokens up to ``hi``; uniform within a bucket."""

    alpha: float
    hi: int = 200_000
    width: int = 1000

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        k = np.arange(1, self.hi // self.width + 1)
        p = k.astype(float) ** -self.alpha
        bucket = rng.choice(k, size=n, p=p / p.sum())
        return (bucket - 1) * self.width + rng.integers(1, self.width + 1, n)


@dataclass(frozen=True)
class Independent:
    """Prompt and output drawn independently; if ``cap_total``, the output is cut so prompt+output <= cap."""

    prefill: LengthDist
    decode: LengthDist
    cap_total: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        p, d = self.prefill.draw(n, rng), self.decode.draw(n, rng)
        if self.cap_total is not None:
            p = np.minimum(p, self.cap_total - 1)
            d = np.maximum(np.minimum(d, self.cap_total - p), 1)
        return p, d


@dataclass(frozen=True)
class TotalSplit:
    """``total`` is prompt+output (Tetris reports those); the output comes from ``decode``, the rest is prompt."""

    total: LengthDist
    decode: LengthDist

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        t, d = self.total.draw(n, rng), self.decode.draw(n, rng)
        d = np.minimum(d, t - 1)
        return t - d, d


@dataclass(frozen=True)
class Mixture:
    parts: tuple[Workload, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.weights) or not self.parts or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"bad mixture weights {self.weights}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        w = np.asarray(self.weights, dtype=float)
        which = rng.choice(len(self.parts), size=n, p=w / w.sum())
        p, d = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for i, part in enumerate(self.parts):
            mask = which == i
            p[mask], d[mask] = part.sample(int(mask.sum()), rng)
        return p, d


@dataclass(frozen=True)
class DriftingMixture:
    """``short`` or ``long`` per request, request i of n long with probability share(i): a raised cosine from
    ``lo`` (i = 0) to ``hi`` (i = n - 1). The index is the arrival order, so the mix drifts over the trace."""

    short: Workload
    long: Workload
    lo: float
    hi: float

    def __post_init__(self) -> None:
        for name in ("lo", "hi"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"long share {name} must be in [0, 1], got {getattr(self, name)}")

    def shares(self, n: int) -> np.ndarray:
        if n < 2:
            return np.full(n, self.lo)
        return self.lo + (self.hi - self.lo) * (1 - np.cos(np.pi * np.arange(n) / (n - 1))) / 2

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        is_long = rng.random(n) < self.shares(n)
        p, d = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for part, mask in ((self.short, ~is_long), (self.long, is_long)):
            p[mask], d[mask] = part.sample(int(mask.sum()), rng)
        return p, d


@dataclass(frozen=True)
class BatchJob:
    """Online traffic plus one batch job: round(``share`` x n) of a trace's n requests are ``batch``'s, all
    submitted at the midpoint of the online requests' arrival span with ``service_class="batch"``. It needs the
    arrival times, so ``make_workload`` builds it (its ``sample`` has no times to give)."""

    online: Workload
    batch: Workload
    share: float

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"batch share must be in [0, 1], got {self.share}")

    def split(self, n: int) -> tuple[int, int]:
        """(online, batch) request counts of an n-request trace."""
        batch = round(self.share * n)
        return n - batch, batch


# Output-length assumptions where a paper reports none (documented above).
LONG_CONTEXT_DECODE = LogNormal.from_quantiles(348, 0.5, 572, 0.99, 1, 4096, clip=True)  # CSPS NeedleBench output
SHORT_DECODE = LogNormal.from_quantiles(128, 0.5, 1024, 0.99, 1, 2048, clip=True)

MEDHA_SHAREGPT4 = Independent(
    LogNormal.from_quantiles(1024, 0.5, 6144, 0.99, 4, 8191),
    LogNormal.from_quantiles(256, 0.5, 1536, 0.99, 1, 4096, clip=True),
    cap_total=8192,
)
MEDHA_LONG = Independent(
    LogNormal.from_quantiles(393_000, 0.5, 839_000, 0.9, 128_000, 1_000_000),
    LogNormal.from_quantiles(518, 0.5, 808, 0.9, 1, 8192, clip=True),
)


def medha_mix(long_share: float = 0.05) -> Mixture:
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    return Mixture((MEDHA_SHAREGPT4, MEDHA_LONG), (1 - long_share, long_share))


def medha_2m(long_share: float = 0.05) -> Mixture:
    """Medha §5.4's 3D workload: ShareGPT4 with `long_share` of 2M-token requests (Medha-SWE's outputs)."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    return Mixture((MEDHA_SHAREGPT4, Independent(Fixed(2_000_000), MEDHA_LONG.decode)), (1 - long_share, long_share))


# Mixed workloads (see the module docstring): a chat body plus long documents, and a batch job's documents.
MIXED_LONG = Independent(LogNormal.from_range(16_000, 256_000), LONG_CONTEXT_DECODE)
MIXED_BATCH_JOB = Independent(
    LogNormal.from_range(8_000, 64_000), LogNormal.from_quantiles(256, 0.5, 1024, 0.99, 1, 2048, clip=True)
)


def mixed_chat(long_share: float = 0.02) -> Mixture:
    """Medha's ShareGPT4 chat with `long_share` of 16K–256K-token documents."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"long share must be in [0, 1], got {long_share}")
    return Mixture((MEDHA_SHAREGPT4, MIXED_LONG), (1 - long_share, long_share))


def mixed_diurnal(lo: float = 0.01, hi: float = 0.20) -> DriftingMixture:
    """``mixed-chat`` whose long share drifts from `lo` to `hi` over the trace (a raised cosine)."""
    return DriftingMixture(MEDHA_SHAREGPT4, MIXED_LONG, lo, hi)


def mixed_batch(batch_share: float = 0.1) -> BatchJob:
    """``mixed-chat`` online traffic plus a batch job of `batch_share` of the requests."""
    return BatchJob(mixed_chat(), MIXED_BATCH_JOB, batch_share)


def _tetris(lo: int, hi: int, mean: float) -> TotalSplit:
    return TotalSplit(LogNormal.from_range_mean(lo, hi, mean), LONG_CONTEXT_DECODE)


def _loongserve_zipf(alpha: float) -> Independent:
    if not alpha > 0:
        raise ValueError(f"zipf alpha must be > 0, got {alpha}")
    return Independent(ZipfBuckets(alpha), LONG_CONTEXT_DECODE)


def _csps(median: float, p99: float, out_median: float, out_p99: float) -> Independent:
    return Independent(
        LogNormal.from_quantiles(median, 0.5, p99, 0.99, 1, 1_000_000, clip=True),
        LogNormal.from_quantiles(out_median, 0.5, out_p99, 0.99, 1, 4096, clip=True),
    )


# Seesaw arxiv-summarization (Vidur trace statistics, see the module docstring).
SEESAW_ARXIV = Independent(
    ScaledBeta.from_mean_median(2588, 2730, 4096),
    lognormal_with_tail(291, 167, 3273, 2048, 4096),
)

_SHAREGPT = Independent(LogNormal.from_range(4, 2300), SHORT_DECODE)
_L_EVAL = Independent(LogNormal.from_range(2700, 210_500), LONG_CONTEXT_DECODE)
_LV_EVAL = Independent(LogNormal.from_range(15_100, 497_300), LONG_CONTEXT_DECODE)

WORKLOADS: dict[str, Workload | BatchJob] = {
    "tetris-short": _tetris(4000, 95_000, 23_600),
    "tetris-medium": _tetris(8000, 142_000, 32_800),
    "tetris-long": _tetris(16_000, 190_000, 50_100),
    "loongserve-sharegpt": _SHAREGPT,
    "loongserve-l-eval": _L_EVAL,
    "loongserve-lv-eval": _LV_EVAL,
    "loongserve-mixed": Mixture((_SHAREGPT, _L_EVAL, _LV_EVAL), (1.0, 1.0, 1.0)),
    "loongserve-zipf-1.0": _loongserve_zipf(1.0),
    "loongserve-zipf-1.2": _loongserve_zipf(1.2),
    "loongserve-zipf-1.4": _loongserve_zipf(1.4),
    "medha-sharegpt4": MEDHA_SHAREGPT4,
    "medha-long": MEDHA_LONG,
    "medha-mix": medha_mix(0.05),
    "csps-needlebench": _csps(113_000, 995_000, 348, 572),
    "csps-bookcorpus": _csps(97_000, 406_000, 375, 631),
    "seesaw-arxiv": SEESAW_ARXIV,
    "mixed-chat": mixed_chat(),
    "mixed-diurnal": mixed_diurnal(),
    "mixed-batch": mixed_batch(),
}


def _shares(args: str, count: int) -> list[float]:
    """`count` ':'-separated shares, each in [0, 1] (ValueError naming the bad one)."""
    parts = args.split(":")
    if len(parts) != count:
        raise ValueError(f"expected {count} share(s) separated by ':', got {args!r}")
    out = []
    for part in parts:
        try:
            share = float(part)
        except ValueError:
            raise ValueError(f"share {part!r} is not a number") from None
        if not 0 <= share <= 1:
            raise ValueError(f"share {part} is not in [0, 1]")
        out.append(share)
    return out


def resolve_workload(name: str) -> Workload | BatchJob:
    """A registered name, or ``constant:P:D``, ``loongserve-zipf:ALPHA``, ``medha-mix:SHARE``, ``medha-2m:SHARE``,
    ``mixed-chat:SHARE``, ``mixed-diurnal:LO:HI``, ``mixed-batch:SHARE``."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    head, _, args = name.partition(":")
    try:
        if head == "constant":
            p, d = (int(x) for x in args.split(":"))
            if p < 1 or d < 1:
                raise ValueError
            return Independent(Fixed(p), Fixed(d))
        if head == "loongserve-zipf":
            return _loongserve_zipf(float(args))
        if head == "medha-mix":
            return medha_mix(float(args))
        if head == "medha-2m":
            return medha_2m(float(args))
        if head == "mixed-chat":
            return mixed_chat(*_shares(args, 1))
        if head == "mixed-diurnal":
            return mixed_diurnal(*_shares(args, 2))
        if head == "mixed-batch":
            return mixed_batch(*_shares(args, 1))
    except ValueError as e:
        raise ValueError(f"bad workload arguments in {name!r}: {e}") from e
    raise ValueError(
        f"unknown workload {name!r}; known: {sorted(WORKLOADS)} or constant:P:D, loongserve-zipf:ALPHA, "
        "medha-mix:SHARE, medha-2m:SHARE, mixed-chat:SHARE, mixed-diurnal:LO:HI, mixed-batch:SHARE"
    )


TRACE_PREFIX = "trace:"  # a workload name `trace:PATH` replays a trace file (traces.read_trace)


@functools.lru_cache(maxsize=8)
def _trace_file(path: str, mtime_ns: int) -> tuple[TraceRequest, ...]:
    return tuple(read_trace(path))


def trace_file(path: str) -> tuple[TraceRequest, ...]:
    """The requests of a trace file, read once while it is unchanged."""
    try:
        mtime = Path(path).stat().st_mtime_ns
    except OSError as e:
        raise ValueError(f"cannot read the trace {path}: {e}") from e
    return _trace_file(path, mtime)


def make_workload(
    name: str | Workload | BatchJob,
    num_requests: int,
    rate: float | None,
    seed: int,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> list[TraceRequest]:
    """``num_requests`` requests of workload ``name`` arriving at ``rate`` req/s, in arrival order; deterministic
    for ``seed``. A ``BatchJob``'s online requests take the arrival process and its batch requests all arrive at
    the midpoint of their span (sorted in after the online requests arriving at or before it). ``trace:PATH``
    replays a trace file (``traces.replay``: its first requests, repeated when it is shorter, scaled to ``rate``;
    ``rate`` None: at the recorded times; the seed, arrival process and cv do not apply)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if isinstance(name, str) and name.startswith(TRACE_PREFIX):
        return replay(trace_file(name[len(TRACE_PREFIX) :]), num_requests, rate)
    if rate is None:
        raise ValueError(f"workload {name!r} needs an arrival rate (only a trace file has recorded arrival times)")
    workload = resolve_workload(name) if isinstance(name, str) else name
    process = Arrival(arrival, rate, cv)
    # the batch job's lengths get a third child seed, so the online part is the plain workload's trace
    arrival_rng, length_rng, batch_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    job = workload if isinstance(workload, BatchJob) else None
    num_online, num_batch = job.split(num_requests) if job is not None else (num_requests, 0)
    online = job.online if job is not None else workload
    assert not isinstance(online, BatchJob)
    times = process.times(num_online, arrival_rng)
    prefill, decode = online.sample(num_online, length_rng)
    out = [TraceRequest(float(t), int(p), int(d)) for t, p, d in zip(times, prefill, decode, strict=True)]
    if job is None or num_batch == 0:
        return out
    at = float((times[0] + times[-1]) / 2) if num_online else 0.0
    prefill, decode = job.batch.sample(num_batch, batch_rng)
    out += [TraceRequest(at, int(p), int(d), "batch") for p, d in zip(prefill, decode, strict=True)]
    return sorted(out, key=lambda r: r.arrived_at)  # stable: online requests first at a tie
