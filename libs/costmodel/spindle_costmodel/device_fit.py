"""A device's efficiencies fitted to the real engine's measured steps, checked on samples the fit never saw.

`spindle profile` measures prefill chunks (history C, chunk L, on an SP group of size s) and decode steps
(batch, KV tokens per request) on this machine; here those samples become `fit.Sample` queries on a
`CostModel` (`prefill(L, C, Parallelism(sp=s))`, `decode(batch, kv)`), and `fit_device`:
1. splits them by grid point into a train and a held-out half (`split_heldout`: every other point of each
   (kind, SP size) group in grid order, so each half spans the grid),
2. fits the named efficiencies on the train half and predicts every sample with that fit (the validation
   table; the held-out rows are the honest error),
3. refits on all samples: the hardware to store.
Pure: no engine, no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .costs import CostModel
from .fit import Sample, fit_efficiency, relative_errors
from .hardware import Efficiency, Hardware, Link
from .model import ModelShape
from .parallel import Parallelism

KINDS = ("prefill", "decode")
# kv_memory: the paged KV reads run at about half the weights' bandwidth; overlap: small CPU GEMMs do not hide
# their memory reads behind compute. kernel_s and iteration_s are both fixed costs per step (only their sum counts)
BASE_PARAMS = ("gemm", "attention", "memory", "kv_memory", "overlap", "kernel_s", "iteration_s")
SP_PARAM = "ring_step_s"


@dataclass(frozen=True)
class DeviceSample:
    """One measured step: a prefill chunk of `tokens` after `history` on `sp` ranks, or a decode step of `batch`
    requests over `kv_tokens` cached tokens each. `share` is the fraction of the device each rank ran on: an SP
    group measured as local processes on one machine splits its cores (1 / sp of them when it fills them)."""

    kind: str
    seconds: float
    sp: int = 1
    history: int = 0
    tokens: int = 0
    batch: int = 0
    kv_tokens: float = 0.0
    share: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"sample kind must be one of {KINDS}, got {self.kind!r}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"measured seconds must be positive and finite, got {self.seconds}")
        if self.sp < 1:
            raise ValueError(f"sp must be >= 1, got {self.sp}")
        if self.kind == "prefill" and (self.tokens < 1 or self.history < 0):
            raise ValueError(f"a prefill sample needs tokens >= 1 and history >= 0, got {self.tokens}, {self.history}")
        if self.kind == "decode" and (self.batch < 1 or not self.kv_tokens >= 0 or self.sp != 1):
            raise ValueError(f"a decode sample needs batch >= 1, kv_tokens >= 0 and sp 1, got {self}")
        if not (math.isfinite(self.share) and 0 < self.share <= 1):
            raise ValueError(f"share must be in (0, 1], got {self.share}")

    @property
    def key(self) -> tuple[Any, ...]:
        """Its grid point: what orders samples and splits them."""
        if self.kind == "prefill":
            return (self.kind, self.sp, self.history, self.tokens)
        return (self.kind, self.sp, self.batch, self.kv_tokens)

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill sp={self.sp} C={self.history} L={self.tokens}"
        return f"decode batch={self.batch} kv={self.kv_tokens:g}"

    def predict(self, cm: CostModel) -> float:
        """Seconds the cost model gives this step (on `share` of the device's FLOP/s and bandwidth per rank)."""
        if self.share < 1:
            hw = cm.hw
            part = replace(hw, peak_flops=hw.peak_flops * self.share, mem_bandwidth=hw.mem_bandwidth * self.share)
            cm = CostModel(cm.model, part, cm.mem_utilization)
        if self.kind == "prefill":
            return cm.prefill(self.tokens, self.history, Parallelism(sp=self.sp)).total_s
        return cm.decode(self.batch, round(self.kv_tokens)).total_s

    def as_fit_sample(self) -> Sample:
        return Sample(query=self.predict, seconds=self.seconds, label=self.label)


def member_share(sp: int, member_threads: int, cores: int) -> float:
    """The fraction of a `cores`-core machine each of `sp` local processes of `member_threads` threads gets."""
    if sp < 1 or member_threads < 1 or cores < 1:
        raise ValueError(f"sp, member_threads and cores must be >= 1, got {sp}, {member_threads}, {cores}")
    return min(1.0, member_threads / max(cores, sp * member_threads))


def samples_from_rows(
    prefill_rows: Sequence[Sequence[float]],
    decode_rows: Sequence[Sequence[float]],
    *,
    sp_member_threads: int | None = None,
    cores: int | None = None,
) -> list[DeviceSample]:
    """Samples from a profile's rows: prefill [sp, history, chunk, seconds], decode [tp, kvp, batch, KV tokens of
    the whole batch, seconds] (the scheduler's `SAMPLE_COLUMNS`); only single-device decodes (tp = kvp = 1).

    With `sp_member_threads` and `cores`, SP > 1 rows were measured as local processes of that many threads on
    one machine of that many cores: each rank had its `member_share` of the device (else a whole device)."""
    if (sp_member_threads is None) != (cores is None):
        raise ValueError("give both sp_member_threads and cores, or neither")
    out = []
    for row in prefill_rows:
        if len(row) != 4:
            raise ValueError(f"a prefill row is [sp, history, chunk, seconds], got {list(row)}")
        sp, hist, chunk, seconds = row
        share = 1.0
        if int(sp) > 1 and sp_member_threads is not None and cores is not None:
            share = member_share(int(sp), sp_member_threads, cores)
        out.append(
            DeviceSample("prefill", float(seconds), sp=int(sp), history=int(hist), tokens=int(chunk), share=share)
        )
    for row in decode_rows:
        if len(row) != 5:
            raise ValueError(f"a decode row is [tp, kvp, batch, kv_tokens, seconds], got {list(row)}")
        tp, kvp, batch, kv_total, seconds = row
        if int(tp) != 1 or int(kvp) != 1:
            raise ValueError(f"only tp = kvp = 1 decode samples are fitted, got tp={tp} kvp={kvp}")
        if int(batch) < 1:
            raise ValueError(f"decode batch must be >= 1, got {batch}")
        out.append(DeviceSample("decode", float(seconds), batch=int(batch), kv_tokens=float(kv_total) / int(batch)))
    return out


def split_heldout(samples: Sequence[DeviceSample]) -> tuple[list[DeviceSample], list[DeviceSample]]:
    """(train, held out): within each (kind, SP size) group in grid order, the odd positions are held out, so
    every group keeps its first point (and all of a one-point group) for the fit."""
    groups: dict[tuple[str, int], list[DeviceSample]] = {}
    for s in sorted(samples, key=lambda s: s.key):
        groups.setdefault((s.kind, s.sp), []).append(s)
    train, heldout = [], []
    for group in groups.values():
        for i, s in enumerate(group):
            (heldout if i % 2 else train).append(s)
    return train, heldout


def default_params(samples: Sequence[DeviceSample]) -> tuple[str, ...]:
    """The efficiencies fitted: the five of one device, plus the ring's per-step cost where SP > 1 was measured."""
    return (*BASE_PARAMS, SP_PARAM) if any(s.sp > 1 for s in samples) else BASE_PARAMS


def measured_hardware(
    base: Hardware,
    *,
    peak_flops: float,
    mem_bandwidth: float,
    mem_bytes: float,
    link: Link | None = None,
    source: str = "",
) -> Hardware:
    """`base` with this machine's measured peak (a matmul's FLOP/s), copy bandwidth and memory, and the link
    between its local ranks when measured (as intra- and inter-node tier alike: there is only one here)."""
    for name, value in (("peak_flops", peak_flops), ("mem_bandwidth", mem_bandwidth), ("mem_bytes", mem_bytes)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be positive and finite, got {value}")
    links = {"intra": link, "inter": link} if link is not None else {}
    return replace(
        base,
        peak_flops=float(peak_flops),
        mem_bandwidth=float(mem_bandwidth),
        mem_bytes=float(mem_bytes),
        host_mem_bytes=float(mem_bytes),
        source=source or base.source,
        **links,
    )


@dataclass(frozen=True)
class DeviceFit:
    hardware: Hardware  # fitted on all samples: the one to use
    train_hardware: Hardware  # fitted on the train half: the one the validation predicts with
    params: tuple[str, ...]
    validation: tuple[dict[str, Any], ...]  # every sample, train and held out, predicted by `train_hardware`
    fit_errors: tuple[float, ...]  # relative errors of `hardware` on all samples

    def _errors(self, split: str) -> list[float]:
        return [abs(r["error"]) for r in self.validation if r["split"] == split]

    @property
    def heldout_mean_abs_error(self) -> float | None:
        errors = self._errors("heldout")
        return sum(errors) / len(errors) if errors else None

    @property
    def heldout_max_abs_error(self) -> float | None:
        errors = self._errors("heldout")
        return max(errors) if errors else None

    @property
    def fit_mean_abs_error(self) -> float:
        return sum(abs(e) for e in self.fit_errors) / len(self.fit_errors)


def _fit(
    model: ModelShape, hw: Hardware, samples: Sequence[DeviceSample], params: Sequence[str], iters: int, minimax: float
) -> Hardware:
    fit_samples = [s.as_fit_sample() for s in samples]
    return fit_efficiency(model, hw, fit_samples, params, iters, minimax, restarts=3).hardware


def validation_row(sample: DeviceSample, predicted: float, split: str) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": sample.kind, "sp": sample.sp}
    if sample.kind == "prefill":
        row |= {"history": sample.history, "tokens": sample.tokens}
    else:
        row |= {"batch": sample.batch, "kv_tokens": sample.kv_tokens}
    return row | {
        "measured_s": sample.seconds,
        "predicted_s": predicted,
        "error": predicted / sample.seconds - 1,
        "split": split,
    }


def fit_device(
    samples: Sequence[DeviceSample],
    base: Hardware,
    model: ModelShape,
    *,
    params: Sequence[str] | None = None,
    heldout: bool = True,
    iters: int = 300,
    minimax: float = 0.0,
) -> DeviceFit:
    """Fit `params` (default: `default_params`) of `base`'s efficiencies to the samples on `model`'s shape.

    With `heldout`, the validation table predicts every sample from a fit to the train half (`split_heldout`);
    without, from the fit to all (no held-out rows: every row is `train`). The returned hardware is always the
    fit to all samples."""
    if not samples:
        raise ValueError("no samples to fit")
    chosen = tuple(params) if params is not None else default_params(samples)
    known = {f.name for f in fields(Efficiency)}
    if not chosen or any(p not in known for p in chosen):
        raise ValueError(f"params must name efficiency fields {sorted(known)}, got {list(chosen)}")
    if SP_PARAM in chosen and not any(s.sp > 1 for s in samples):
        raise ValueError(f"{SP_PARAM} is not identifiable without SP > 1 samples")
    train, held = split_heldout(samples) if heldout else (list(samples), [])
    train_hw = _fit(model, base, train, chosen, iters, minimax)
    cm = CostModel(model, train_hw)
    split = {id(s): "heldout" for s in held}
    ordered = sorted(samples, key=lambda s: s.key)
    validation = tuple(validation_row(s, s.predict(cm), split.get(id(s), "train")) for s in ordered)
    full_hw = _fit(model, train_hw, samples, chosen, iters, minimax) if held else train_hw
    errors = relative_errors(model, full_hw, [s.as_fit_sample() for s in samples])
    return DeviceFit(full_hw, train_hw, chosen, validation, errors)


def format_validation(rows: Sequence[dict[str, Any]]) -> str:
    """The validation table as text: one line per sample, then the held-out mean and max error."""
    head = ("split", 8, "<"), ("kind", 8, "<"), ("sp", 3, ">"), ("C / batch", 11, ">"), ("L / kv", 9, ">")
    head += ("measured ms", 13, ">"), ("predicted ms", 14, ">"), ("error", 9, ">")
    lines = ["".join(f"{name:{align}{width}}" for name, width, align in head)]
    for r in rows:
        a, b = (r["history"], r["tokens"]) if r["kind"] == "prefill" else (r["batch"], round(r["kv_tokens"]))
        lines.append(
            f"{r['split']:<8}{r['kind']:<8}{r['sp']:>3}{a:>11}{b:>9}{r['measured_s'] * 1e3:>13.2f}"
            f"{r['predicted_s'] * 1e3:>14.2f}{r['error']:>+9.1%}"
        )
    held = [abs(r["error"]) for r in rows if r["split"] == "heldout"]
    if held:
        lines.append(f"held out: {len(held)} samples, mean |error| {sum(held) / len(held):.1%}, max {max(held):.1%}")
    return "\n".join(lines)
