"""The mixed-batch step-time predictor: one iteration of prefill chunks and decodes on a colocated instance.

Per TP degree of the instance:

    T = dense(tokens) + c_hist * sum(C_i * L_i) + c_sq * sum(L_i^2) + c_kv * K

- `tokens` = sum of the chunks' lengths L_i plus one per decode: what passes the dense layers (projections, MLP,
  norms, TP all-reduces, the iteration's fixed cost). `dense` is piecewise linear through a grid of token counts,
  because on a GPU the weights' read time floors small batches (a decode batch and a 512-token chunk can cost
  about the same) while large ones are compute-bound;
- chunk i attends over its C_i tokens of history and causally over itself (the C*L and L^2 terms);
- the decodes attend over K cached tokens in all.

Fitted to the cost model (`calibration.mixed_from_cost_model`: the dense grid from its dense ops, the attention
coefficients by least squares on its attention ops) or built from a profile's Eq. 1 prefill fit and decode-step
fit (`from_parts`). Pure Python on the hot path: a strategy calls it several times per iteration.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DECODE_RANGE = 64  # `from_parts`: token counts up to this may be a decode batch (the decode step's form applies)


@dataclass(frozen=True)
class MixedFit:
    """One TP degree's coefficients: `dense` seconds at `grid` token counts (ascending), then per-term costs."""

    grid: tuple[float, ...]
    dense: tuple[float, ...]
    c_hist: float  # seconds per (history token x chunk token)
    c_sq: float  # seconds per chunk token squared
    c_kv: float  # seconds per cached token a decode attends over

    def __post_init__(self) -> None:
        if len(self.grid) < 2 or len(self.grid) != len(self.dense):
            raise ValueError(f"the dense grid needs >= 2 points and one time per point: {self.grid}, {self.dense}")
        if any(b <= a for a, b in zip(self.grid, self.grid[1:], strict=False)) or self.grid[0] < 1:
            raise ValueError(f"grid token counts must ascend from >= 1: {self.grid}")
        if not all(np.isfinite([*self.dense, self.c_hist, self.c_sq, self.c_kv])):
            raise ValueError("mixed-batch coefficients must be finite")

    def dense_s(self, tokens: float) -> float:
        """Dense-layer seconds of `tokens` tokens: linear between grid points, the end segments extended."""
        g, d = self.grid, self.dense
        i = min(max(bisect.bisect_right(g, tokens), 1), len(g) - 1)
        x0, x1, y0, y1 = g[i - 1], g[i], d[i - 1], d[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def predict(self, chunks: Iterable[tuple[int, int]], num_decodes: int = 0, decode_kv: float = 0) -> float:
        """Seconds of one iteration: `chunks` as (history, length) pairs, `num_decodes` decodes over `decode_kv`
        cached tokens in all. An empty iteration takes 0."""
        tokens, attn = float(num_decodes), 0.0
        for history, length in chunks:
            tokens += length
            attn += self.c_hist * history * length + self.c_sq * length * length
        if tokens <= 0:
            return 0.0
        return max(0.0, self.dense_s(tokens) + attn + self.c_kv * decode_kv)


@dataclass(frozen=True)
class MixedBatchModel:
    """fits[tp]: the predictor of a colocated instance of that TP degree."""

    fits: Mapping[int, MixedFit]
    errors: Mapping[int, float] = field(default_factory=dict)  # mean relative error on the samples it was fitted to

    def __post_init__(self) -> None:
        if not self.fits:
            raise ValueError("a mixed-batch model needs at least one TP degree")

    def fit_for(self, tp: int) -> MixedFit:
        if tp not in self.fits:
            raise ValueError(f"no mixed-batch model for tp={tp}; have {sorted(self.fits)}")
        return self.fits[tp]

    def predict(self, tp: int, chunks: Iterable[tuple[int, int]], num_decodes: int = 0, decode_kv: float = 0) -> float:
        """Seconds of one iteration at `tp` (MixedFit.predict)."""
        return self.fit_for(tp).predict(chunks, num_decodes, decode_kv)

    def largest_chunk(
        self,
        tp: int,
        history: int,
        limit: int,
        budget_s: float,
        chunks: Iterable[tuple[int, int]] = (),
        num_decodes: int = 0,
        decode_kv: float = 0,
    ) -> int:
        """The longest chunk (at most `limit` tokens) after `history` tokens that, added to the batch (`chunks`
        and the decodes), keeps the iteration within `budget_s`; 0 when not even one token fits."""
        f = self.fit_for(tp)
        tokens, fixed = float(num_decodes), f.c_kv * decode_kv
        for h, length in chunks:
            tokens += length
            fixed += f.c_hist * h * length + f.c_sq * length * length

        def seconds(n: float) -> float:  # the iteration with an n-token chunk added
            return f.dense_s(tokens + n) + fixed + f.c_hist * history * n + f.c_sq * n * n

        if limit < 1 or seconds(1) > budget_s:
            return 0
        if seconds(limit) <= budget_s:
            return limit
        # the dense grid segment where the budget runs out, then the quadratic solved on it
        g = f.grid
        lo, hi = 0, len(g) - 1  # the last grid point within the budget, by bisection (seconds grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if g[mid] <= tokens or seconds(g[mid] - tokens) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        k = min(lo, len(g) - 2)
        x0, x1, y0, y1 = g[k], g[k + 1], f.dense[k], f.dense[k + 1]
        slope = (y1 - y0) / (x1 - x0)
        a = y0 + slope * (tokens - x0) + fixed - budget_s
        b = slope + f.c_hist * history
        c = f.c_sq
        root = -a / b if b > 0 else float(limit)  # of b n + a = 0, or of c n^2 + b n + a = 0 below
        if c > 0:
            root = (-b + math.sqrt(max(0.0, b * b - 4 * c * a))) / (2 * c)
        n = int(root)
        n = min(max(n, 1), limit - 1)
        while n > 1 and seconds(n) > budget_s:  # float rounding at the root
            n -= 1
        while n + 1 < limit and seconds(n + 1) <= budget_s:
            n += 1
        return n

    # ---- built from a profile's fits ----

    @classmethod
    def from_parts(cls, prefill: Any, decode: Any, tps: Iterable[int]) -> MixedBatchModel:
        """From Eq. 1 at SP 1 (`PrefillLatencyModel`: a + b L + c C L + d L^2) and the decode step at (tp, 1)
        (`DecodeStepModel`: e + f B + g K): up to DECODE_RANGE tokens the dense time is the larger of the decode
        step's e + f n and the prefill's a + b n (a batch that small may be all decodes), above it the prefill's."""
        if prefill is None or 1 not in prefill.coeffs:
            raise ValueError("a mixed-batch model from parts needs Eq. 1 at SP size 1")
        a, b, c, d = prefill.coeffs[1]
        fits = {}
        for tp in tps:
            e, f, g = decode.coeffs[(tp, 1)] if decode is not None and (tp, 1) in decode.coeffs else (a, b, 0.0)
            grid = tuple(float(2**k) for k in range(21))
            dense = tuple(max(e + f * n, a + b * n) if n <= DECODE_RANGE else a + b * n for n in grid)
            fits[tp] = MixedFit(grid, dense, c, d, g)
        return cls(fits)

    # ---- JSON ----

    def to_dict(self) -> list[dict[str, Any]]:
        return [
            {"tp": tp, "grid": list(f.grid), "dense": list(f.dense), "c_hist": f.c_hist, "c_sq": f.c_sq,
             "c_kv": f.c_kv, "fit_error": self.errors.get(tp)}
            for tp, f in sorted(self.fits.items())
        ]  # fmt: skip

    @classmethod
    def from_dict(cls, data: Iterable[Mapping[str, Any]]) -> MixedBatchModel:
        fits, errors = {}, {}
        for r in data:
            tp = int(r["tp"])
            fits[tp] = MixedFit(tuple(map(float, r["grid"])), tuple(map(float, r["dense"])), float(r["c_hist"]),
                                float(r["c_sq"]), float(r["c_kv"]))  # fmt: skip
            if r.get("fit_error") is not None:
                errors[tp] = float(r["fit_error"])
        return cls(fits, errors)
