"""Fitting a device's efficiencies to measured (or published) latencies, minimising log errors.

A sample is a query on a `CostModel` and the seconds it took; the fit changes only the `Efficiency` fields
named, each kept inside its valid range, and minimises the mean squared log ratio of predicted to measured
(Levenberg-Marquardt), or that plus a weight on the worst sample (Nelder-Mead, for a minimax trade-off).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from .costs import CostModel
from .hardware import Efficiency, Hardware
from .model import ModelShape

Query = Callable[[CostModel], float]
FRACTIONS = ("gemm", "attention", "memory", "kv_memory", "overlap")


@dataclass(frozen=True)
class Sample:
    query: Query
    seconds: float
    label: str = ""


@dataclass(frozen=True)
class FitResult:
    hardware: Hardware
    errors: tuple[float, ...]  # relative error per sample, predicted / measured - 1

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean(np.abs(self.errors)))

    @property
    def max_abs_error(self) -> float:
        return float(np.max(np.abs(self.errors)))


def relative_errors(model: ModelShape, hw: Hardware, samples: Sequence[Sample]) -> tuple[float, ...]:
    cm = CostModel(model, hw)
    return tuple(s.query(cm) / s.seconds - 1 for s in samples)


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iters: int, step: float = 0.3) -> np.ndarray:
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        reflected = centroid + (centroid - worst)
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - worst)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (worst - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


# the range a fitted parameter is kept in (log space): a direction the samples barely constrain otherwise runs
# off to an exp() overflow or underflow that no `Efficiency` accepts
FRACTION_BOUNDS = (1e-4, 1.0)
SECONDS_BOUNDS = (1e-9, 10.0)


def _levenberg_marquardt(
    residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray, iters: int
) -> np.ndarray:
    """Least squares of `residuals` over the box [lo, hi] (steps clipped to it), forward-difference Jacobian."""
    x = np.clip(x0, lo, hi)
    r = residuals(x)
    cost, damping = float(r @ r), 1e-2
    for _ in range(iters):
        jac = np.empty((len(r), len(x)))
        for i in range(len(x)):
            h = np.zeros_like(x)
            h[i] = 1e-4 if x[i] + 1e-4 <= hi[i] else -1e-4
            jac[:, i] = (residuals(x + h) - r) / h[i]
        a, g = jac.T @ jac, jac.T @ r
        while True:
            step = np.linalg.solve(a + damping * (np.diag(np.diag(a)) + 1e-12 * np.eye(len(x))), -g)
            x_new = np.clip(x + step, lo, hi)
            r_new = residuals(x_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                done = cost - c_new < 1e-12 * max(cost, 1e-30)
                x, r, cost, damping = x_new, r_new, c_new, max(damping / 3, 1e-9)
                break
            damping *= 4
            if damping > 1e8:
                return x
        if done:
            break
    return x


def fit_efficiency(
    model: ModelShape,
    hw: Hardware,
    samples: Sequence[Sample],
    params: Sequence[str],
    iters: int = 400,
    minimax: float = 0.0,
    restarts: int = 1,
) -> FitResult:
    """`hw` with the named efficiencies fitted to the samples (the others kept), each inside its bounds.
    `minimax` > 0 adds that weight of the worst sample's squared log error to the mean, trading mean error for
    the worst case; `restarts` > 1 rebuilds the simplex where the last run stopped (Nelder-Mead stalls on flat
    directions)."""
    if not samples:
        raise ValueError("no samples to fit")
    known = {f.name for f in fields(Efficiency)}
    if unknown := [p for p in params if p not in known]:
        raise ValueError(f"unknown efficiency parameters {unknown}; known: {sorted(known)}")
    if any(not (math.isfinite(s.seconds) and s.seconds > 0) for s in samples):
        raise ValueError("measured seconds must be positive and finite")
    bounds = [FRACTION_BOUNDS if p in FRACTIONS else SECONDS_BOUNDS for p in params]
    lo, hi = np.log([b[0] for b in bounds]), np.log([b[1] for b in bounds])

    def build(x: np.ndarray) -> Hardware:
        values = np.exp(np.clip(x, lo, hi))
        return hw.with_efficiency(**{p: float(v) for p, v in zip(params, values, strict=True)})

    def log_errors(x: np.ndarray) -> np.ndarray:
        return np.log1p(np.array(relative_errors(model, build(x), samples)))

    def loss(x: np.ndarray) -> float:
        sq = log_errors(x) ** 2
        return float(np.mean(sq) + minimax * np.max(sq))

    start = [getattr(hw.eff, p) if getattr(hw.eff, p) is not None else hw.eff.memory for p in params]
    x = np.clip(np.log(np.maximum(start, SECONDS_BOUNDS[0])), lo, hi)
    if minimax == 0:  # a sum of squares: Levenberg-Marquardt converges where the simplex stalls
        x = _levenberg_marquardt(log_errors, x, lo, hi, iters)
    for _ in range(max(1, restarts) if minimax else 0):
        x = np.clip(_nelder_mead(loss, x, iters), lo, hi)
    fitted = build(x)
    return FitResult(fitted, relative_errors(model, fitted, samples))
