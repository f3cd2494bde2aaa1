"""Every attention backend of `spindle_attention.backends`, held to the same numerics and timed, on one device.

Each backend is built the way the engine builds it (`select_backend(device, name, block_size=...)`) and called
through the `AttentionBackend` ops the engine calls: `attention_fwd` (varlen causal GQA prefill, and a ring step:
non-causal, with LSE), `paged_decode` and `paged_prefill` (a chunk on top of a paged history). A backend that
cannot run on the device is listed once with the registry's reason; a call its kernels cannot express (it raises
`Unsupported`, and the engine would run its fallback) is reported as `fallback` with the reason, not timed.

Numerics: the oracle is the `reference` backend run in float32 on the same inputs upcast (inputs are N(0, 1),
drawn in the case's dtype, so oracle and backend see the same values). Reported: the max abs error and the max
relative error (max |out - ref| / max |ref|) of out, the max abs error of the LSE, and `ok` when every element
satisfies |x - ref| <= atol + rtol * |ref| (the `err/tol` column is the worst element's share of its bound):

    dtype  out atol  out rtol  lse atol  why
    fp32   1e-4      1e-4      1e-4      kernels accumulate in fp32; a mask or indexing bug is off by O(0.1-1)
    fp16   5e-3      5e-3      1e-3      ~4x the worst case of rounding the output and the probabilities P
    bf16   2e-2      2e-2      1e-3      before P @ V: about 2^-9 * max|v| ~ 1e-2 in bf16 (8x less in fp16)

(LSE is fp32 in every backend, from q.k products that are exact in fp32: only the summation order differs.)

Speed: median time per call (CUDA: events around each call, after warm-up calls and with the L2 cache flushed
before each; CPU: `time.perf_counter`), TFLOP/s for prefill (causal 2*2*T*T*Hq*D/2 per sequence, a ring step
non-causal 2*2*Tq*Tk*Hq*D, a paged chunk of n after h cached tokens 2*2*Hq*D*(n*h + n*n/2)) and GB/s of K/V
read for decode (2 * sum(seq_lens) * Hkv * D * itemsize). `x base` is the speed-up over triton on CUDA, over
the reference on CPU. The paged cache is `[num_blocks, 256, Hkv, D]` (flash-attn's paged kernels need a block
size that is a multiple of 256) with shuffled blocks; a cache larger than --kv-pool-gib reuses physical blocks
across sequences (random rows, so concurrent reads rarely share one), and GB/s counts logical bytes.

Exit status: 1 when a backend fails numerics or raises (other than `Unsupported` or running out of memory),
0 otherwise. JSON (machine, versions, backend availability, every row) is rewritten after each case.

    python bench/bench_backends.py --device cuda                       # full set, bf16/fp16/fp32
    python bench/bench_backends.py --device cuda --quick --dtypes bf16 # a few shapes, a smoke test
    python bench/bench_backends.py --device cuda --dry-run             # list the cases and their memory only
    python bench/bench_backends.py --device cpu                        # quick shapes (reference vs cpu)
    TRITON_INTERPRET=1 python bench/bench_backends.py --device cpu     # tiny shapes, the triton backend too
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from spindle_attention.backends import (
    AttentionBackend,
    Unsupported,
    backend_names,
    get_backend,
    parse_device,
    select_backend,
)

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional: no progress bar then
    tqdm = None

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPS = ("prefill", "ring", "decode", "paged_prefill")
ORDER = ("reference", "cpu", "triton", "flash-attn")  # table order; other registered backends follow
GiB = 1 << 30
FLUSH_BYTES = 256 << 20  # zeroed before each timed CUDA call so no call finds its K/V in L2 (H100: 50 MiB)
ORACLE_CHUNK_BYTES = 2 * GiB  # the paged oracle upcasts the blocks of this many bytes' worth of rows at a time
REF_DECODE_SPLIT = 8192  # spindle_attention.paged.DECODE_SPLIT_TOKENS: keys the reference gathers at once
INTERP_BF16 = "triton's interpreter gets tl.dot wrong on bfloat16 operands; bf16 is checked compiled, on CUDA"


@dataclass(frozen=True)
class Tol:
    out_atol: float
    out_rtol: float
    lse_atol: float


TOLERANCES = {"fp32": Tol(1e-4, 1e-4, 1e-4), "fp16": Tol(5e-3, 5e-3, 1e-3), "bf16": Tol(2e-2, 2e-2, 1e-3)}


# --- cases ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One call shape. prefill/ring: q_lens/k_lens per packed sequence; decode: one query per sequence, k_lens its
    seq_lens; paged_prefill: q_lens the chunks, k_lens each sequence's cached tokens (the chunk included)."""

    op: str
    hq: int
    hkv: int
    d: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool = True

    @property
    def batch(self) -> int:
        return len(self.k_lens)

    def label(self) -> str:
        heads = f"H{self.hq}/{self.hkv} D{self.d}"
        if self.op == "prefill":
            t = sum(self.q_lens)
            seqs = f"T={t}" if self.batch == 1 else f"T={t} in {self.batch} seqs"
            return f"{seqs} {heads}"
        if self.op == "ring":
            return f"Tq={sum(self.q_lens)} Tk={sum(self.k_lens)} {heads}"
        ctx = str(self.k_lens[0]) if len(set(self.k_lens)) == 1 else ",".join(map(str, self.k_lens))
        if self.op == "decode":
            return f"B={self.batch} ctx={ctx} {heads}"
        chunk = str(self.q_lens[0]) if len(set(self.q_lens)) == 1 else ",".join(map(str, self.q_lens))
        return f"B={self.batch} chunk={chunk} ctx={ctx} {heads}"

    def flops(self) -> float:
        per = 2 * 2 * self.hq * self.d
        if self.op == "prefill":
            return float(sum(per * n * n / 2 for n in self.q_lens))
        if self.op == "ring":
            return float(sum(per * nq * nk for nq, nk in zip(self.q_lens, self.k_lens, strict=True)))
        if self.op == "paged_prefill":
            return float(sum(per * (n * (t - n) + n * n / 2) for n, t in zip(self.q_lens, self.k_lens, strict=True)))
        return float(sum(per * t for t in self.k_lens))  # decode

    def kv_bytes(self, itemsize: int) -> int:
        """K and V bytes one call reads (every cached token of every sequence once)."""
        return 2 * sum(self.k_lens) * self.hkv * self.d * itemsize


def _prefill(hq: int, hkv: int, d: int, lens: Iterable[int]) -> Case:
    lens = tuple(lens)
    return Case("prefill", hq, hkv, d, lens, lens)


def _ring(hq: int, hkv: int, d: int, tq: int, tk: int) -> Case:
    return Case("ring", hq, hkv, d, (tq,), (tk,), causal=False)


def _decode(hq: int, hkv: int, d: int, ctxs: Iterable[int]) -> Case:
    ctxs = tuple(ctxs)
    return Case("decode", hq, hkv, d, (1,) * len(ctxs), ctxs)


def _paged_prefill(hq: int, hkv: int, d: int, chunks: Iterable[int], totals: Iterable[int]) -> Case:
    return Case("paged_prefill", hq, hkv, d, tuple(chunks), tuple(totals))


def build_cases(shapes: str) -> list[Case]:
    """tiny: the triton interpreter's size; quick: ~1 min on a 2-core CPU; full: realistic shapes for a GPU."""
    if shapes == "tiny":
        h = (4, 2, 64)
        return [
            _prefill(*h, (48, 80)),
            _ring(*h, 64, 96),
            _decode(*h, (300, 512)),
            _paged_prefill(*h, (32, 16), (300, 200)),
        ]
    if shapes == "quick":
        return [
            _prefill(8, 2, 128, (1024,)),
            _prefill(8, 2, 64, (512, 256, 256)),
            _ring(8, 2, 128, 512, 1024),
            _decode(8, 2, 128, (4096,)),
            _decode(8, 2, 128, (2048,) * 8),
            _paged_prefill(8, 2, 128, (256, 256), (2048, 1792)),
        ]
    if shapes == "gpu-quick":
        h = (32, 8, 128)
        return [
            _prefill(*h, (4096,)),
            _ring(*h, 4096, 4096),
            _decode(*h, (8192,) * 32),
            _paged_prefill(*h, (2048,), (10240,)),
        ]
    h = (32, 8, 128)
    cases = [
        _prefill(*h, (4096,)),
        _prefill(*h, (16384,)),
        _prefill(*h, (8192, 4096, 2048, 1024, 1024)),
        _prefill(32, 8, 64, (4096,)),
        _prefill(32, 8, 64, (16384,)),
        _ring(*h, 4096, 4096),
        _ring(*h, 16384, 16384),
    ]
    cases += [_decode(*h, (ctx,) * b) for ctx in (8192, 32768, 131072) for b in (1, 32, 128)]
    cases += [
        _paged_prefill(*h, (2048,), (10240,)),
        _paged_prefill(*h, (512,) * 4, (32768,) * 4),
        _paged_prefill(*h, (4096,), (131072,)),
    ]
    return cases


# --- inputs and the oracle ------------------------------------------------------------------------------------


@dataclass
class Paged:
    k_cache: Tensor  # [P, block_size, Hkv, D]
    v_cache: Tensor
    table: Tensor  # [B, max_blocks] int32
    seq_lens: Tensor  # [B] int32


def pool_blocks(case: Case, block_size: int, itemsize: int, pool_cap: float) -> tuple[int, int]:
    """(logical blocks, physical blocks): the cache holds at most `pool_cap` bytes (0: no cap), but never fewer
    blocks than the longest sequence needs, so a row's blocks are distinct."""
    per_row = [math.ceil(t / block_size) for t in case.k_lens]
    logical = sum(per_row)
    block_bytes = 2 * block_size * case.hkv * case.d * itemsize
    if pool_cap <= 0:
        return logical, logical
    return logical, min(logical, max(max(per_row), int(pool_cap // block_bytes)))


def make_paged(case: Case, dtype: torch.dtype, device: torch.device, block_size: int, pool_cap: float, seed: int):
    logical, physical = pool_blocks(case, block_size, dtype.itemsize, pool_cap)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (physical, block_size, case.hkv, case.d)
    k_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
    per_row = [math.ceil(t / block_size) for t in case.k_lens]
    width = max(per_row)
    gcpu = torch.Generator().manual_seed(seed + 1)
    table = torch.zeros(case.batch, width, dtype=torch.int32)
    if physical == logical:  # every block its own: one shuffle of the whole cache
        perm = torch.randperm(physical, generator=gcpu, dtype=torch.int32)
        start = 0
        for b, n in enumerate(per_row):
            table[b, :n] = perm[start : start + n]
            start += n
    else:  # each row draws distinct blocks of the pool at random; rows share blocks
        for b, n in enumerate(per_row):
            table[b, :n] = torch.randperm(physical, generator=gcpu, dtype=torch.int32)[:n]
    seq_lens = torch.tensor(case.k_lens, dtype=torch.int32)
    return Paged(k_cache, v_cache, table.to(device), seq_lens.to(device))


def _cu(lens: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)  # [B+1]


@dataclass
class Inputs:
    """A case's tensors, and how to run it on a backend (`call`) and on the fp32 oracle (`oracle`)."""

    dtype: torch.dtype
    call: Callable[[AttentionBackend], tuple[Tensor, Tensor]]
    oracle: Callable[[AttentionBackend], tuple[Tensor, Tensor]]
    pool_bytes: int = 0


def make_inputs(
    case: Case, dtype: torch.dtype, device: torch.device, block_size: int, pool_cap: float, seed: int
) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    if case.op in ("prefill", "ring"):
        q = randn(sum(case.q_lens), case.hq, case.d)  # [Tq, Hq, D]
        k = randn(sum(case.k_lens), case.hkv, case.d)  # [Tk, Hkv, D]
        v = randn(sum(case.k_lens), case.hkv, case.d)
        cu_q, cu_k = _cu(case.q_lens, device), _cu(case.k_lens, device)

        def call(be: AttentionBackend) -> tuple[Tensor, Tensor]:
            return be.attention_fwd(q, k, v, causal=case.causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

        def oracle(ref: AttentionBackend) -> tuple[Tensor, Tensor]:
            return ref.attention_fwd(
                q.float(), k.float(), v.float(), causal=case.causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
            )

        return Inputs(dtype, call, oracle)

    cache = make_paged(case, dtype, device, block_size, pool_cap, seed + 7)
    pool_bytes = 2 * cache.k_cache.numel() * cache.k_cache.element_size()
    row_fp32 = 2 * cache.table.shape[1] * block_size * case.hkv * case.d * 4
    rows = max(1, ORACLE_CHUNK_BYTES // row_fp32)  # rows whose blocks the oracle upcasts at once

    def sub_cache(r0: int, r1: int) -> tuple[Tensor, Tensor, Tensor]:
        """The blocks rows [r0, r1) use, upcast, and their table renumbered into them."""
        used, inverse = torch.unique(cache.table[r0:r1], return_inverse=True)
        return cache.k_cache[used].float(), cache.v_cache[used].float(), inverse.to(torch.int32)

    if case.op == "decode":
        q = randn(case.batch, case.hq, case.d)  # [B, Hq, D]

        def call(be: AttentionBackend) -> tuple[Tensor, Tensor]:
            return be.paged_decode(q, cache.k_cache, cache.v_cache, cache.table, cache.seq_lens)

        def oracle(ref: AttentionBackend) -> tuple[Tensor, Tensor]:
            outs, lses = [], []
            for r0 in range(0, case.batch, rows):
                r1 = min(r0 + rows, case.batch)
                kc, vc, table = sub_cache(r0, r1)
                o, s = ref.paged_decode(q[r0:r1].float(), kc, vc, table, cache.seq_lens[r0:r1])
                outs.append(o)
                lses.append(s)
                del kc, vc
            return torch.cat(outs), torch.cat(lses, dim=1)

        return Inputs(dtype, call, oracle, pool_bytes)

    q = randn(sum(case.q_lens), case.hq, case.d)  # paged_prefill: [sum(chunks), Hq, D]
    cu_q = _cu(case.q_lens, device)
    starts = [0, *itertools.accumulate(case.q_lens)]

    def call(be: AttentionBackend) -> tuple[Tensor, Tensor]:
        return be.paged_prefill(q, cache.k_cache, cache.v_cache, cache.table, cache.seq_lens, cu_q)

    def oracle(ref: AttentionBackend) -> tuple[Tensor, Tensor]:
        outs, lses = [], []
        for r0 in range(0, case.batch, rows):
            r1 = min(r0 + rows, case.batch)
            kc, vc, table = sub_cache(r0, r1)
            cu = torch.tensor([s - starts[r0] for s in starts[r0 : r1 + 1]], dtype=torch.int32, device=device)
            qs = q[starts[r0] : starts[r1]].float()
            o, s = ref.paged_prefill(qs, kc, vc, table, cache.seq_lens[r0:r1], cu)
            outs.append(o)
            lses.append(s)
            del kc, vc
        return torch.cat(outs), torch.cat(lses, dim=1)

    return Inputs(dtype, call, oracle, pool_bytes)


# --- memory ---------------------------------------------------------------------------------------------------


def estimate_bytes(case: Case, itemsize: int, block_size: int, pool_cap: float) -> tuple[int, int]:
    """(bytes the case needs without timing the reference, extra bytes the reference's timing needs): inputs,
    outputs, the oracle's fp32 copies and working set; the reference's gathers on the paged ops."""
    hq, hkv, d = case.hq, case.hkv, case.d
    tq, tk = sum(case.q_lens), sum(case.k_lens)
    q_out = 2 * tq * hq * d * (itemsize + 4) + 4 * hq * tq * 4  # q, out in dtype and fp32; LSEs
    if case.op in ("prefill", "ring"):
        kv = 2 * tk * hkv * d * (itemsize + 4)
        tile = 6 * hq * 1024 * 1024 * 4  # the reference's score tiles (1024 x 1024 per head) and their exp
        return q_out + kv + tile + FLUSH_BYTES, tile
    _, physical = pool_blocks(case, block_size, itemsize, pool_cap)
    pool = 2 * physical * block_size * hkv * d * itemsize
    oracle = 3 * ORACLE_CHUNK_BYTES
    if case.op == "decode":
        # per split of REF_DECODE_SPLIT keys: K and V gathered in the dtype, upcast, and copied by einsum
        keys = case.batch * min(max(case.k_lens), REF_DECODE_SPLIT)
        ref = 2 * keys * hkv * d * (itemsize + 4 + 4)
    else:
        ref = 6 * hq * 1024 * 1024 * 4 + 2 * max(case.k_lens) * hkv * d * (itemsize + 4)  # tiles, gathered keys
    return pool + q_out + oracle + FLUSH_BYTES, ref


# --- numerics -------------------------------------------------------------------------------------------------


def compare(out: Tensor, lse: Tensor, ref_out: Tensor, ref_lse: Tensor, tol: Tol) -> dict[str, Any]:
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        raise ValueError(f"shapes out {tuple(out.shape)} lse {tuple(lse.shape)}, expected {tuple(ref_out.shape)}")
    diff = (out.float() - ref_out).abs().nan_to_num(nan=math.inf)
    scale = ref_out.abs()
    out_ratio = float((diff / (tol.out_atol + tol.out_rtol * scale)).max()) if diff.numel() else 0.0
    out_abs = float(diff.max()) if diff.numel() else 0.0
    peak = float(scale.max()) if scale.numel() else 0.0
    both_empty = torch.isneginf(lse) & torch.isneginf(ref_lse)  # a query that sees no key: (0, -inf) in both
    lse_diff = torch.where(both_empty, 0.0, (lse.float() - ref_lse).abs()).nan_to_num(nan=math.inf)
    lse_abs = float(lse_diff.max()) if lse_diff.numel() else 0.0
    ratio = max(out_ratio, lse_abs / tol.lse_atol)
    return {
        "out_abs_err": out_abs,
        "out_rel_err": out_abs / peak if peak > 0 else out_abs,
        "lse_abs_err": lse_abs,
        "err_over_tol": ratio,
        "ok": ratio <= 1.0,
    }


# --- timing ---------------------------------------------------------------------------------------------------


class Timer:
    """Median time of a call: CUDA events around each call, the L2 flushed first; perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int, min_reps: int, budget_s: float) -> None:
        self.device, self.warmup, self.reps, self.min_reps, self.budget_s = device, warmup, reps, min_reps, budget_s
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], object]) -> tuple[float, int]:
        """(median ms, calls timed); the caller has already made one call (compile, first-use work)."""
        for _ in range(self.warmup):  # slow calls (the reference at long contexts) get one warm-up call
            t0 = time.perf_counter()
            fn()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            if time.perf_counter() - t0 > 0.1:
                break
        times: list[float] = []
        started = time.perf_counter()
        while True:
            if self.cuda:
                assert self.flush is not None
                self.flush.zero_()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            spent = time.perf_counter() - started
            if len(times) >= self.reps or (len(times) >= self.min_reps and spent >= self.budget_s):
                return statistics.median(times), len(times)


# --- the run --------------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, backends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flash_attn": _version("flash_attn") or _version("flash-attn"),
        "flash_attn_status": backends.get("flash-attn", {}).get("reason") or "available",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GiB, 1),
            "sm_count": props.multi_processor_count,
            "capability": f"sm{props.major}{props.minor}",
            "cuda": torch.version.cuda,
        }
    return info


def backend_table(device: torch.device, block_size: int, wanted: list[str] | None) -> dict[str, dict[str, Any]]:
    names = [n for n in ORDER if n in backend_names()] + [n for n in backend_names() if n not in ORDER]
    table = {}
    for name in names:
        if wanted is not None and name not in wanted and name != "reference":
            continue
        reason = get_backend(name).unavailable(device, block_size)
        table[name] = {"available": reason is None, "reason": reason, "timed": wanted is None or name in wanted}
    return table


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _num(x: float | None) -> str:
    """A rate with about three significant digits, never in exponent form."""
    if x is None:
        return "-"
    return format(x, ".0f" if x >= 100 else ".1f" if x >= 10 else ".2f" if x >= 1 else ".3f")


COLUMNS = (
    ("op", 13),
    ("shape", 38),
    ("dtype", 5),
    ("backend", 10),
    ("out err", 8),
    ("rel", 8),
    ("lse err", 8),
    ("err/tol", 7),
    ("ok", 8),
    ("ms", 9),
    ("rate", 13),
    ("x base", 6),
)


def aligned(cells: list[str]) -> str:
    """The first len(cells) columns: text left-aligned, numbers right-aligned."""
    widths = COLUMNS[: len(cells)]
    return "  ".join(
        f"{c:<{w}}" if i < 4 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, widths, strict=True))
    )


def fmt_row(case: Case, dtype: str, r: dict[str, Any]) -> str:
    lead = [case.op, case.label(), dtype, r["backend"]]
    if r["status"] not in ("ok", "FAIL"):
        return f"{aligned(lead)}  {r['status']}: {r.get('reason', '')}"
    rate = f"{_num(r.get('gbps'))} GB/s" if case.op == "decode" else f"{_num(r.get('tflops'))} TF/s"
    line = aligned(
        [
            *lead,
            _fmt(r["out_abs_err"], ".1e"),
            _fmt(r["out_rel_err"], ".1e"),
            _fmt(r["lse_abs_err"], ".1e"),
            _fmt(r["err_over_tol"], ".2f"),
            r["status"],
            _fmt(r.get("ms"), ".3f"),
            rate,
            _fmt(r.get("x_base"), ".2f"),
        ]
    )
    return f"{line}  {r['reason']}" if r.get("reason") else line


def run_backend(
    be: AttentionBackend, fallback: str | None, inputs: Inputs, ref: tuple[Tensor, Tensor], tol: Tol, timer: Timer
) -> dict[str, Any]:
    """Check one backend's first call against the oracle, then time it. `be` has no fallback, so a call its
    kernels cannot express raises `Unsupported` (reported with `fallback`, the backend the engine would use)."""
    row: dict[str, Any] = {"backend": be.name}
    try:
        out, lse = inputs.call(be)
        if be.device.type == "cuda":
            torch.cuda.synchronize(be.device)
    except Unsupported as e:
        return row | {"status": "fallback", "reason": f"{e} (the engine runs it on {fallback!r})"}
    except torch.OutOfMemoryError as e:
        return row | {"status": "oom", "reason": str(e).splitlines()[0][:200]}
    except Exception as e:  # a crash is a failure: the engine would crash the same way
        return row | {"status": "ERROR", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    row |= compare(out, lse, ref[0], ref[1], tol)
    if out.dtype != inputs.dtype:
        row["ok"] = False
        row["reason"] = f"out dtype {out.dtype}, expected {inputs.dtype}"
    del out, lse
    row["status"] = "ok" if row["ok"] else "FAIL"
    try:
        row["ms"], row["reps"] = timer(lambda: inputs.call(be))
    except torch.OutOfMemoryError as e:
        row["reason"] = f"timing ran out of memory: {str(e).splitlines()[0][:200]}"
    except Exception as e:  # a later call failing where the first one passed
        row |= {"status": "ERROR", "reason": f"timing: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument(
        "--shapes",
        choices=("auto", "tiny", "quick", "full"),
        default="auto",
        help="case set; auto: full on CUDA (quick with --quick), quick on CPU, tiny on CPU under TRITON_INTERPRET=1",
    )
    p.add_argument("--quick", action="store_true", help="a few shapes (a smoke test); on CPU always")
    p.add_argument(
        "--dtypes", default="bf16,fp16,fp32", help="comma-separated, run in this order (default: bf16,fp16,fp32)"
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to time (default: every registered one); the reference always runs as oracle",
    )
    p.add_argument(
        "--block-size", type=int, default=256, help="tokens per KV block (flash-attn needs a multiple of 256)"
    )
    p.add_argument(
        "--kv-pool-gib",
        type=float,
        default=8.0,
        help="at most this many GiB of physical K/V blocks per case; longer caches reuse blocks across sequences "
        "(0: every block distinct, and cases that do not fit are skipped)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed calls at most (default: 30 on CUDA, 10 on CPU)")
    p.add_argument("--min-reps", type=int, default=3, help="timed calls at least")
    p.add_argument(
        "--time-per-call-s", type=float, default=None, help="stop timing a call after this (CUDA 1, CPU 0.5)"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed calls after the checked one (CUDA 3, CPU 0)")
    p.add_argument("--budget-s", type=float, default=None, help="skip the cases left after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/backends_<device>.json)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their memory estimates, run nothing")
    args = p.parse_args(argv)
    try:
        args.dev = parse_device(args.device)
    except ValueError as e:
        p.error(str(e))
    args.dtype_names = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    bad = [s for s in args.dtype_names if s not in DTYPES]
    if bad or not args.dtype_names:
        p.error(f"--dtypes takes {','.join(DTYPES)}, got {args.dtypes!r}")
    args.op_names = [s.strip() for s in args.ops.split(",") if s.strip()]
    if not set(args.op_names) <= set(OPS) or not args.op_names:
        p.error(f"--ops takes {','.join(OPS)}, got {args.ops!r}")
    args.wanted = None if args.backends is None else [s.strip() for s in args.backends.split(",") if s.strip()]
    for name in args.wanted or []:
        if name not in backend_names():
            p.error(f"unknown backend {name!r}; registered: {', '.join(backend_names())}")
    cuda = args.dev.type == "cuda"
    if args.shapes == "auto":
        if cuda:
            args.shapes = "quick" if args.quick else "full"
        else:
            args.shapes = "tiny" if _interpreting() else "quick"
    elif args.quick and args.shapes == "full":
        p.error("--quick contradicts --shapes full")
    args.reps = args.reps or (30 if cuda else 10)
    args.time_per_call_s = args.time_per_call_s if args.time_per_call_s is not None else (1.0 if cuda else 0.5)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 0)
    args.out = args.out or Path(__file__).parent / "results" / f"backends_{args.dev.type}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev: torch.device = args.dev
    cuda = dev.type == "cuda"
    case_set = "gpu-quick" if cuda and args.shapes == "quick" else args.shapes
    cases = [c for c in build_cases(case_set) if c.op in args.op_names]
    work = [(dtype, case) for dtype in args.dtype_names for case in cases]
    pool_cap = args.kv_pool_gib * GiB

    if args.dry_run:
        print(
            f"{len(work)} cases ({case_set} shapes), block size {args.block_size}, K/V pool cap {args.kv_pool_gib} GiB"
        )
        for dtype, case in work:
            isz = DTYPES[dtype].itemsize
            need, ref_extra = estimate_bytes(case, isz, args.block_size, pool_cap)
            logical, physical = pool_blocks(case, args.block_size, isz, pool_cap)
            paged = f"  blocks {physical}/{logical}" if case.op in ("decode", "paged_prefill") else ""
            print(
                f"  {case.op:<13} {case.label():<38} {dtype:<4}  {case.flops() / 1e12:8.3f} TFLOP  "
                f"K/V {case.kv_bytes(isz) / GiB:7.2f} GiB{paged}  needs ~{need / GiB:5.1f} GiB "
                f"(+{ref_extra / GiB:.1f} timing the reference)"
            )
        return 0

    if cuda:
        if not torch.cuda.is_available():
            sys.exit("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        if _interpreting():
            sys.exit("unset TRITON_INTERPRET: on CUDA the benchmark must run compiled kernels")
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle in true fp32
        torch.backends.cudnn.allow_tf32 = False
        if dev.index is not None:  # set_device refuses an index-less "cuda"
            torch.cuda.set_device(dev)

    availability = backend_table(dev, args.block_size, args.wanted)
    ref_backend = select_backend(dev, "reference", block_size=args.block_size)
    built: dict[str, AttentionBackend] = {}
    for name, entry in availability.items():
        if not entry["available"] or not entry["timed"]:
            continue
        be = select_backend(dev, name, block_size=args.block_size)
        # calls the kernels cannot express raise `Unsupported` here instead of running (and being timed) on the
        # fallback: the table says which backend the engine would use for them
        entry["fallback"] = be.fallback.name if be.fallback is not None else None
        be.fallback = None
        built[name] = be
    baseline = "triton" if cuda else "reference"
    timer = Timer(dev, args.warmup, args.reps, args.min_reps, args.time_per_call_s)
    interp = not cuda and _interpreting()

    info = machine_info(dev, availability)
    who = info.get("gpu", info["cpu"])
    print(f"device {dev}: {who}  torch {info['torch']}  triton {info['triton']}  flash_attn {info['flash_attn']}")
    for name, entry in availability.items():
        state = "runs" if entry["available"] else f"skipped: {entry['reason']}"
        if entry["available"] and not entry["timed"]:
            state = "oracle only (not in --backends)"
        print(f"  backend {name:<10} {state}")
    print(
        f"{len(work)} cases ({case_set} shapes); tolerance |x - ref| <= atol + rtol*|ref|: "
        + ", ".join(f"{k} {v.out_atol:g}+{v.out_rtol:g}|ref| (lse {v.lse_atol:g})" for k, v in TOLERANCES.items())
    )
    print(f"x base: speed-up over {baseline}; rate: TFLOP/s (prefill, ring, paged_prefill) or GB/s of K/V (decode)")
    print(aligned([name for name, _ in COLUMNS]))

    result: dict[str, Any] = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path | torch.device) else v) for k, v in vars(args).items()},
        "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "rel_err": "max |out - ref| / max |ref|",
        "ok": "every element |x - ref| <= atol + rtol * |ref| (out), |lse - ref| <= lse atol",
        "baseline": baseline,
        "backends": availability,
        "cases": [],
    }
    failures: list[str] = []
    started = time.perf_counter()
    bar = tqdm(work, desc="cases", unit="case", disable=None, file=sys.stderr) if tqdm is not None else work

    def say(line: str) -> None:
        (tqdm.write if tqdm is not None else print)(line)
        sys.stdout.flush()

    for dtype_name, case in bar:
        dtype = DTYPES[dtype_name]
        entry: dict[str, Any] = {
            "op": case.op,
            "shape": case.label(),
            "dtype": dtype_name,
            **{k: v for k, v in asdict(case).items() if k != "op"},
            "flops": case.flops(),
            "kv_bytes": case.kv_bytes(dtype.itemsize),
            "rows": [],
        }
        result["cases"].append(entry)
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            entry["skipped"] = f"--budget-s {args.budget_s:g} spent"
            say(f"{aligned([case.op, case.label(), dtype_name, '*'])}  skipped: {entry['skipped']}")
            continue
        need, ref_extra = estimate_bytes(case, dtype.itemsize, args.block_size, pool_cap)
        free = None
        if cuda:
            _free(cuda)
            free = torch.cuda.mem_get_info(dev)[0]
            entry["estimated_bytes"] = need
            if need > 0.9 * free:
                entry["skipped"] = (
                    f"needs ~{need / GiB:.1f} GiB (K/V pool, oracle, inputs), {free / GiB:.1f} GiB free; "
                    "lower the shape or set --kv-pool-gib"
                )
                say(f"{aligned([case.op, case.label(), dtype_name, '*'])}  skipped: {entry['skipped']}")
                _write(args.out, result, failures, started)
                continue
        try:
            inputs = make_inputs(case, dtype, dev, args.block_size, pool_cap, args.seed)
            entry["kv_pool_bytes"] = inputs.pool_bytes or None
            ref = inputs.oracle(ref_backend)
        except torch.OutOfMemoryError as e:
            entry["skipped"] = f"out of memory building the inputs or the oracle: {str(e).splitlines()[0][:200]}"
        except Exception as e:  # the oracle itself failing is a failure of the run
            entry["skipped"] = f"ERROR building the inputs or the oracle: {type(e).__name__}: {e}"
            failures.append(f"{case.op} {case.label()} {dtype_name} oracle: {type(e).__name__}")
        if "skipped" in entry:
            say(f"{aligned([case.op, case.label(), dtype_name, 'reference'])}  skipped: {entry['skipped']}")
            inputs = ref = None  # type: ignore[assignment]
            _free(cuda)
            _write(args.out, result, failures, started)
            continue
        tol = TOLERANCES[dtype_name]
        rows: list[dict[str, Any]] = []
        for name, be in built.items():
            if name == "triton" and interp and dtype == torch.bfloat16:
                rows.append({"backend": name, "status": "skip", "reason": INTERP_BF16})
            elif name == "triton" and interp and case_set != "tiny":
                rows.append(
                    {"backend": name, "status": "skip", "reason": "under TRITON_INTERPRET=1 only --shapes tiny"}
                )
            elif name == "reference" and cuda and free is not None and need + ref_extra > 0.9 * free:
                reason = f"timing the reference needs ~{(need + ref_extra) / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
                rows.append({"backend": name, "status": "skip", "reason": reason})
            else:
                rows.append(run_backend(be, availability[name]["fallback"], inputs, ref, tol, timer))
            if cuda:
                torch.cuda.empty_cache()
        base_ms = next((r.get("ms") for r in rows if r["backend"] == baseline), None)
        for r in rows:
            ms = r.get("ms")
            if ms:
                if case.op == "decode":
                    r["gbps"] = case.kv_bytes(dtype.itemsize) / (ms * 1e-3) / 1e9
                else:
                    r["tflops"] = case.flops() / (ms * 1e-3) / 1e12
                r["x_base"] = base_ms / ms if base_ms else None
            if r["status"] in ("FAIL", "ERROR"):
                failures.append(f"{case.op} {case.label()} {dtype_name} {r['backend']}: {r['status']}")
            say(fmt_row(case, dtype_name, r))
        entry["rows"] = rows
        del inputs, ref
        _free(cuda)
        _write(args.out, result, failures, started)
    if tqdm is not None:
        bar.close()  # type: ignore[union-attr]
    _write(args.out, result, failures, started)
    checked = sum(r["status"] in ("ok", "FAIL") for c in result["cases"] for r in c["rows"])
    print(f"{checked} backend runs checked, {len(failures)} failed; wrote {args.out}")
    for f in failures:
        print(f"  FAILED {f}")
    return 1 if failures else 0


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _write(path: Path, result: dict[str, Any], failures: list[str], started: float) -> None:
    result["failures"] = failures
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
