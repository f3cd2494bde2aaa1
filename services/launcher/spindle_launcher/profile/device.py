"""This machine as a cost-model device: its peaks measured with torch, its efficiencies fitted to the engine.

`measure_peaks` times a square matmul (the best of a few runs, on torch's threads as the engine uses them)
and a large tensor copy; `device_section` turns those, the measured transfer model and the prefill / decode
samples into the profile's `device` section through `spindle_costmodel.device_fit` (pure): the `cpu` preset
with the measured peaks, its efficiencies fitted on half the grid, checked on the other half, refitted on all.
"""

from __future__ import annotations

import os
import time
from typing import Any

from spindle_costmodel.device_fit import fit_device, measured_hardware, samples_from_rows
from spindle_costmodel.hardware import CPU, Link, hardware_to_dict
from spindle_costmodel.model import DTYPE_BYTES, ModelShape
from spindle_policy.latency import TransferModel
from spindle_policy.profile_data import Rows

from .sp import MEMBER_THREADS

# weight of the worst sample in the fit: on this machine's grid it trades ~0.5 % of mean held-out error for ~3 %
# of the worst (7.3 / 20.2 % -> 7.8 / 17.5 %)
MINIMAX = 0.3


def _best_seconds(fn: Any, repeats: int) -> float:
    fn()  # untimed: first-call allocations, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(dtype: str = "float32", sizes: tuple[int, ...] = (1024, 2048), repeats: int = 3) -> dict[str, float]:
    """{matmul_flops, copy_bandwidth, mem_bytes}: the best square matmul's FLOP/s in `dtype` over `sizes`, the bytes
    read + written per second of a 256 MiB copy, and the machine's total RAM."""
    import torch

    from spindle_engine.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    gen = torch.Generator().manual_seed(0)
    flops = 0.0
    with torch.no_grad():
        for n in sizes:
            a = torch.randn(n, n, generator=gen).to(DTYPES[dtype])
            b = torch.randn(n, n, generator=gen).to(DTYPES[dtype])
            c = torch.empty(n, n, dtype=DTYPES[dtype])
            flops = max(flops, 2.0 * n**3 / _best_seconds(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeats))
        src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB: far past the caches
        dst = torch.empty_like(src)
        bandwidth = 2.0 * src.nbytes / _best_seconds(lambda: dst.copy_(src), repeats)
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return {"matmul_flops": flops, "copy_bandwidth": bandwidth, "mem_bytes": ram, "threads": torch.get_num_threads()}


def best_peaks(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The higher of two `measure_peaks` results (other work on the machine only ever lowers them)."""
    return {k: max(a[k], b[k]) if k in ("matmul_flops", "copy_bandwidth") else a[k] for k in a}


def model_shape(name: str, config: Any, dtype: str) -> ModelShape:
    """The cost model's shape of a loaded `spindle_model` model (its `ModelConfig`) in `dtype`."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return ModelShape(
        name=name,
        layers=config.num_layers,
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        dtype_bytes=DTYPE_BYTES[dtype],
        tied_embeddings=config.tie_word_embeddings,
    )


def device_section(
    peaks: dict[str, float],
    shape: ModelShape,
    prefill_rows: Rows,
    decode_rows: Rows,
    transfer: TransferModel | None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The profile's `device` section: {measured, hardware, params, validation, heldout_mean_abs_error,
    heldout_max_abs_error, fit_mean_abs_error}. SP > 1 samples ran as local processes of `sp.MEMBER_THREADS`
    threads each, so each member had its share of this machine's cores (`device_fit.member_share`)."""
    cores = os.cpu_count() or 1
    link = Link("gloo", transfer.bandwidth_bytes_per_s, transfer.latency_s) if transfer is not None else None
    base = measured_hardware(
        CPU,
        peak_flops=peaks["matmul_flops"],
        mem_bandwidth=peaks["copy_bandwidth"],
        mem_bytes=peaks["mem_bytes"],
        link=link,
        source=f"this machine ({cores} cores, {dtype}): peaks measured with torch, "
        f"efficiencies fitted to the engine by `spindle profile` on {shape.name}",
    )
    samples = samples_from_rows(prefill_rows, decode_rows, sp_member_threads=MEMBER_THREADS, cores=cores)
    fit = fit_device(samples, base, shape, minimax=MINIMAX)
    return {
        "measured": peaks,
        "hardware": hardware_to_dict(fit.hardware),
        "params": list(fit.params),
        "validation": list(fit.validation),
        "heldout_mean_abs_error": fit.heldout_mean_abs_error,
        "heldout_max_abs_error": fit.heldout_max_abs_error,
        "fit_mean_abs_error": fit.fit_mean_abs_error,
    }
