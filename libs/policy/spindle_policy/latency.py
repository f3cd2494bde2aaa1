"""Latency models the strategies and the simulator plan with, fitted by least squares.

- `PrefillLatencyModel`: Tetris Eq. 1, per SP size s: T_s = a_s + b_s*L + c_s*(C*L) + d_s*L^2
  (C = history tokens before the chunk, L = tokens in the chunk).
- `BatchPrefillModel`: LoongServe Eq. 7, per parallel configuration p:
  T_p = alpha_p + beta_p*sum(len) + gamma_p*sum(len^2) over the requests of one prefill batch.
- `DecodeStepModel`: one decode step, per (TP, KVP) degree: T = e + f*batch + g*kv_tokens.
- `TransferModel`: seconds = latency + bytes / bandwidth.
- `MixedBatchModel` (mixed_batch.py): one iteration of prefill chunks and decodes on a colocated instance.
- `LatencyModel`: the bundle, serialised as plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .mixed_batch import MixedBatchModel
from .reshard_model import ReshardModel

WEIGHTINGS = ("relative", "absolute")


def _check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def _lstsq(x: np.ndarray, y: np.ndarray, weighting: str) -> np.ndarray:
    """Least-squares coefficients of y ~ x. "relative" minimises the squared relative residuals.

    Columns are scaled to unit max first: L^2 reaches 1e11 while the constant column is 1.
    """
    _check_weighting(weighting)
    if weighting == "relative" and np.any(y <= 0):
        raise ValueError("relative weighting needs positive latencies")
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale * w[:, None]
    if np.linalg.matrix_rank(xs) < x.shape[1]:
        raise ValueError(f"samples do not determine the {x.shape[1]} coefficients (too few or degenerate points)")
    coef, *_ = np.linalg.lstsq(xs, y * w, rcond=None)
    return coef / scale


def _mean_rel_error(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / np.abs(y)))


def _check_seconds(seconds: float) -> float:
    seconds = float(seconds)
    if not np.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"measured latency must be a positive finite number of seconds, got {seconds}")
    return seconds


def _check_count(name: str, value: float) -> float:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value}")
    return float(value)


@dataclass(frozen=True)
class PrefillLatencyModel:
    """Tetris Eq. 1. coeffs[s] = (a, b, c, d); errors[s] = mean relative error of the fit on its samples.

    If no sample of an SP size has history (C = 0 everywhere, e.g. whole-prompt tables like Tetris Table 1),
    c is not identifiable and is set to 2*d: C*L history pairs and the ~L^2/2 causal pairs of the chunk cost
    the same per pair, which makes two chunks of N/2 cost the same attention as one chunk of N.
    """

    coeffs: Mapping[int, tuple[float, float, float, float]]
    errors: Mapping[int, float] = field(default_factory=dict)
    history_inferred: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise ValueError("prefill model needs at least one SP size")
        for sp, c in self.coeffs.items():
            if int(sp) < 1 or len(c) != 4 or not all(np.isfinite(c)):
                raise ValueError(f"bad prefill coefficients for sp={sp}: {c}")

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, float, float, float]], weighting: str = "relative"
    ) -> PrefillLatencyModel:
        """Fit from (sp, C, L, seconds) samples, one coefficient set per SP size."""
        by_sp: dict[int, list[tuple[float, float, float]]] = {}
        for sp, hist, chunk, seconds in samples:
            if int(sp) < 1:
                raise ValueError(f"sp must be >= 1, got {sp}")
            if chunk < 1:
                raise ValueError(f"chunk length L must be >= 1, got {chunk}")
            row = (_check_count("history C", hist), float(chunk), _check_seconds(seconds))
            by_sp.setdefault(int(sp), []).append(row)
        if not by_sp:
            raise ValueError("no samples to fit")
        coeffs, errors, inferred = {}, {}, set()
        for sp, rows in sorted(by_sp.items()):
            arr = np.array(rows)
            hist, chunk, y = arr[:, 0], arr[:, 1], arr[:, 2]
            if np.all(hist == 0):
                a, b, d = _lstsq(np.stack([np.ones_like(chunk), chunk, chunk**2], axis=1), y, weighting)
                c = 2.0 * d
                inferred.add(sp)
            else:
                x = np.stack([np.ones_like(chunk), chunk, hist * chunk, chunk**2], axis=1)
                a, b, c, d = _lstsq(x, y, weighting)
            coeffs[sp] = (float(a), float(b), float(c), float(d))
            pred = a + b * chunk + c * hist * chunk + d * chunk**2
            errors[sp] = _mean_rel_error(pred, y)
        return cls(coeffs=coeffs, errors=errors, history_inferred=frozenset(inferred))

    def sp_sizes(self) -> list[int]:
        return sorted(self.coeffs)

    def predict(self, sp: int, history: float, chunk: float, keep: float = 1.0) -> float:
        """Seconds to prefill `chunk` new tokens after `history` cached tokens on an SP group of size `sp`.

        `keep`: the share of attention pairs computed (CSA's sparsity, `spindle_costmodel.csa.pair_fraction`),
        applied to the pair terms (C*L and L^2) only; the all-to-all bytes CSA saves are not modelled."""
        if sp not in self.coeffs:
            raise ValueError(f"no prefill model for sp={sp}; have {self.sp_sizes()}")
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        hist = _check_count("history C", history)
        n = _check_count("chunk length L", chunk)
        a, b, c, d = self.coeffs[sp]
        return max(0.0, a + b * n + keep * (c * hist * n + d * n * n))  # clamp: a fit may dip below 0 off its data

    def fit_error(self) -> dict[int, float]:
        """Per-SP mean relative error of the fit on the samples it was fitted to."""
        return dict(self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            str(sp): {
                "coeffs": list(c),
                "fit_error": self.errors.get(sp),
                "history_inferred": sp in self.history_inferred,
            }
            for sp, c in sorted(self.coeffs.items())
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrefillLatencyModel:
        coeffs = {int(k): tuple(float(x) for x in v["coeffs"]) for k, v in data.items()}
        errors = {int(k): float(v["fit_error"]) for k, v in data.items() if v.get("fit_error") is not None}
        inferred = frozenset(int(k) for k, v in data.items() if v.get("history_inferred"))
        return cls(coeffs=coeffs, errors=errors, history_inferred=inferred)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BatchPrefillModel:
    """LoongServe Eq. 7. coeffs[p] = (alpha, beta, gamma) for parallel configuration p (its ESP degree)."""

    coeffs: Mapping[int, tuple[float, float, float]]
    errors: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise ValueError("batch prefill model needs at least one configuration")
        for p, c in self.coeffs.items():
            if int(p) < 1 or len(c) != 3 or not all(np.isfinite(c)):
                raise ValueError(f"bad batch prefill coefficients for p={p}: {c}")

    @staticmethod
    def _features(input_lens: Sequence[float]) -> tuple[float, float]:
        if len(input_lens) == 0:
            raise ValueError("a prefill batch needs at least one request")
        lens = np.array([_check_count("input_len", x) for x in input_lens])
        return float(lens.sum()), float((lens**2).sum())

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, Sequence[float], float]], weighting: str = "relative"
    ) -> BatchPrefillModel:
        """Fit from (p, [input_len per request], seconds) samples, one coefficient set per p."""
        by_p: dict[int, list[tuple[float, float, float]]] = {}
        for p, lens, seconds in samples:
            if int(p) < 1:
                raise ValueError(f"parallel degree must be >= 1, got {p}")
            s1, s2 = cls._features(lens)
            by_p.setdefault(int(p), []).append((s1, s2, _check_seconds(seconds)))
        if not by_p:
            raise ValueError("no samples to fit")
        coeffs, errors = {}, {}
        for p, rows in sorted(by_p.items()):
            arr = np.array(rows)
            x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
            coef = _lstsq(x, arr[:, 2], weighting)
            coeffs[p] = tuple(float(v) for v in coef)
            errors[p] = _mean_rel_error(x @ coef, arr[:, 2])
        return cls(coeffs=coeffs, errors=errors)  # type: ignore[arg-type]

    def predict(self, p: int, input_lens: Sequence[float]) -> float:
        if p not in self.coeffs:
            raise ValueError(f"no batch prefill model for p={p}; have {sorted(self.coeffs)}")
        s1, s2 = self._features(input_lens)
        alpha, beta, gamma = self.coeffs[p]
        return max(0.0, alpha + beta * s1 + gamma * s2)

    def fit_error(self) -> dict[int, float]:
        return dict(self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {str(p): {"coeffs": list(c), "fit_error": self.errors.get(p)} for p, c in sorted(self.coeffs.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchPrefillModel:
        coeffs = {int(k): tuple(float(x) for x in v["coeffs"]) for k, v in data.items()}
        errors = {int(k): float(v["fit_error"]) for k, v in data.items() if v.get("fit_error") is not None}
        return cls(coeffs=coeffs, errors=errors)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DecodeStepModel:
    """coeffs[(tp, kvp)] = (e, f, g): step seconds = e + f*batch_size + g*total_kv_tokens."""

    coeffs: Mapping[tuple[int, int], tuple[float, float, float]]
    errors: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise ValueError("decode model needs at least one (tp, kvp) configuration")
        for key, c in self.coeffs.items():
            if len(key) != 2 or min(key) < 1 or len(c) != 3 or not all(np.isfinite(c)):
                raise ValueError(f"bad decode coefficients for {key}: {c}")

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, int, int, float]], weighting: str = "relative") -> DecodeStepModel:
        """Fit from (tp, kvp, batch_size, total_kv_tokens, seconds) samples."""
        by_cfg: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
        for tp, kvp, batch, kv_tokens, seconds in samples:
            if int(tp) < 1 or int(kvp) < 1:
                raise ValueError(f"tp and kvp must be >= 1, got tp={tp} kvp={kvp}")
            if batch < 1:
                raise ValueError(f"batch size must be >= 1, got {batch}")
            row = (float(batch), _check_count("total_kv_tokens", kv_tokens), _check_seconds(seconds))
            by_cfg.setdefault((int(tp), int(kvp)), []).append(row)
        if not by_cfg:
            raise ValueError("no samples to fit")
        coeffs, errors = {}, {}
        for key, rows in sorted(by_cfg.items()):
            arr = np.array(rows)
            x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
            coef = _lstsq(x, arr[:, 2], weighting)
            coeffs[key] = tuple(float(v) for v in coef)
            errors[key] = _mean_rel_error(x @ coef, arr[:, 2])
        return cls(coeffs=coeffs, errors=errors)  # type: ignore[arg-type]

    def predict(self, batch_size: int, total_kv_tokens: float, tp: int = 1, kvp: int = 1) -> float:
        if (tp, kvp) not in self.coeffs:
            raise ValueError(f"no decode model for tp={tp} kvp={kvp}; have {sorted(self.coeffs)}")
        if batch_size < 0:
            raise ValueError(f"batch size must be >= 0, got {batch_size}")
        e, f, g = self.coeffs[(tp, kvp)]
        return max(0.0, e + f * batch_size + g * _check_count("total_kv_tokens", total_kv_tokens))

    def fit_error(self) -> dict[tuple[int, int], float]:
        return dict(self.errors)

    def to_dict(self) -> list[dict[str, Any]]:
        return [
            {"tp": tp, "kvp": kvp, "coeffs": list(c), "fit_error": self.errors.get((tp, kvp))}
            for (tp, kvp), c in sorted(self.coeffs.items())
        ]

    @classmethod
    def from_dict(cls, data: Sequence[Mapping[str, Any]]) -> DecodeStepModel:
        coeffs = {(int(r["tp"]), int(r["kvp"])): tuple(float(x) for x in r["coeffs"]) for r in data}
        errors = {(int(r["tp"]), int(r["kvp"])): float(r["fit_error"]) for r in data if r.get("fit_error") is not None}
        return cls(coeffs=coeffs, errors=errors)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransferModel:
    """KV transfer time: latency_s + bytes / bandwidth_bytes_per_s."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not (np.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> TransferModel:
        """Fit from (bytes, seconds) samples, minimising relative error so small transfers keep their latency."""
        rows = [(_check_count("bytes", b), _check_seconds(s)) for b, s in samples]
        if not rows:
            raise ValueError("no samples to fit")
        arr = np.array(rows)
        x = np.stack([np.ones(len(arr)), arr[:, 0]], axis=1)
        latency, per_byte = _lstsq(x, arr[:, 1], "relative")
        if per_byte <= 0:
            raise ValueError("transfer samples do not show time growing with size")
        return cls(latency_s=max(0.0, float(latency)), bandwidth_bytes_per_s=1.0 / float(per_byte))

    def predict(self, num_bytes: float) -> float:
        return self.latency_s + _check_count("bytes", num_bytes) / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferModel:
        return cls(latency_s=float(data["latency_s"]), bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]))


@dataclass(frozen=True)
class LatencyModel:
    """Everything a strategy or the simulator predicts with; any part may be absent."""

    prefill: PrefillLatencyModel | None = None
    batch_prefill: BatchPrefillModel | None = None
    decode: DecodeStepModel | None = None
    transfer: TransferModel | None = None
    mixed: MixedBatchModel | None = None
    # a re-sharding group's configurations (Seesaw); built from the cost model, not saved in the JSON
    reshard: ReshardModel | None = None
    source: str = ""
    # links (a named cluster's, from the cost model; not saved in the JSON): `transfer` is priced on the link
    # between nodes, `transfer_intra` on the one inside a node; `prefill_cross` / `batch_prefill_cross` are the
    # prefill forms of SP groups whose members sit on different nodes (their collectives on the slower link).
    # None: one link for everything (a profile of one machine, published figures)
    transfer_intra: TransferModel | None = None
    prefill_cross: PrefillLatencyModel | None = None
    batch_prefill_cross: BatchPrefillModel | None = None
    # what the simulator charges for work on the cluster these forms were fitted to (sim/prices.py: the cost model
    # itself on a named cluster); None: the forms themselves. Not saved in the JSON; a strategy never reads it
    ground_truth: Any = field(default=None, repr=False, compare=False)

    def transfer_on(self, cross_nodes: bool) -> TransferModel | None:
        """The transfer model of a move between instances on different nodes (`cross_nodes`) or on one."""
        return self.transfer if cross_nodes or self.transfer_intra is None else self.transfer_intra

    def prefill_seconds(self, sp: int, history: float, chunk: float, keep: float = 1.0, cross_nodes: bool = False
                        ) -> float:  # fmt: skip
        """Eq. 1 for an SP group on one node, or across nodes (`cross_nodes`, where the model has that form)."""
        assert self.prefill is not None
        model = self.prefill
        if cross_nodes and sp > 1 and self.prefill_cross is not None and sp in self.prefill_cross.coeffs:
            model = self.prefill_cross
        return model.predict(sp, history, chunk, keep)

    def batch_prefill_on(self, cross_nodes: bool) -> BatchPrefillModel | None:
        return self.batch_prefill_cross if cross_nodes and self.batch_prefill_cross is not None else self.batch_prefill

    def mixed_model(self, tps: Iterable[int]) -> MixedBatchModel:
        """The mixed-batch predictor at every TP of `tps`: the fitted one's, else built from Eq. 1 and the decode step
        at that TP (without a decode step there: no decode-KV term, e.g. the stages of a 2D pipeline profiled at
        TP 1 only)."""
        want = set(tps)
        have = dict(self.mixed.fits) if self.mixed is not None else {}
        if want <= set(have):
            assert self.mixed is not None
            return self.mixed
        built = MixedBatchModel.from_parts(self.prefill, self.decode, want - set(have))
        return MixedBatchModel({**have, **built.fits}, dict(self.mixed.errors) if self.mixed is not None else {})

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "source": self.source,
                "prefill": self.prefill.to_dict() if self.prefill else None,
                "batch_prefill": self.batch_prefill.to_dict() if self.batch_prefill else None,
                "decode": self.decode.to_dict() if self.decode else None,
                "transfer": self.transfer.to_dict() if self.transfer else None,
                "mixed": self.mixed.to_dict() if self.mixed else None,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> LatencyModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"latency model is not valid JSON: {e}") from e
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a version-1 latency model JSON object")
        return cls(
            prefill=PrefillLatencyModel.from_dict(data["prefill"]) if data.get("prefill") else None,
            batch_prefill=BatchPrefillModel.from_dict(data["batch_prefill"]) if data.get("batch_prefill") else None,
            decode=DecodeStepModel.from_dict(data["decode"]) if data.get("decode") else None,
            transfer=TransferModel.from_dict(data["transfer"]) if data.get("transfer") else None,
            mixed=MixedBatchModel.from_dict(data["mixed"]) if data.get("mixed") else None,
            source=str(data.get("source", "")),
        )
