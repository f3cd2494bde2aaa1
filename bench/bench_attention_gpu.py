"""GPU benchmark of the Triton attention kernels (needs CUDA; run on e.g. an H100).

Prefill: `spindle_attention.triton.attention_fwd` (causal, GQA) against
`torch.nn.functional.scaled_dot_product_attention`, in TFLOP/s with causal FLOPs = 2 * 2 * T * T * Hq * D / 2.
Decode: `spindle_attention.triton.paged_decode` over a shuffled block-paged cache, in GB/s of K/V read, against
SDPA over the same context stored contiguously (a bound for what paging costs).

    python bench/bench_attention_gpu.py                      # full run, writes bench/results/attention_gpu.json
    python bench/bench_attention_gpu.py --quick              # a few small shapes
    python bench/bench_attention_gpu.py --sweep              # also try other tile configs for the prefill kernel
    python bench/bench_attention_gpu.py --sweep --dtypes fp32 --head-dims 64 128 --seqlens 4096 16384 --skip-decode
                                                             # fp32 (IEEE dots): its own, smaller tiles
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spindle_attention import triton as tri

DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (block_q, block_k, num_warps, num_stages) tried by --sweep; None is the kernel's default.
SWEEP_CONFIGS: list[tuple[int, int, int, int] | None] = [
    None,
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (256, 64, 8, 2),
    (256, 128, 8, 2),
]


# fp32 tiles take twice the registers and shared memory: smaller tiles and more warps. On an H200 the default
# (64, 32, 4, 2) ran prefill at 1 TFLOP/s at head_dim 128 (10 at 64; bench/results/backends_cuda.json).
FP32_SWEEP_CONFIGS: list[tuple[int, int, int, int] | None] = [
    None,
    (64, 32, 8, 2),
    (32, 32, 4, 2),
    (32, 32, 8, 2),
    (32, 64, 4, 2),
    (64, 16, 4, 2),
    (64, 64, 8, 2),
    (16, 32, 4, 2),
]


# (block_k, num_warps, num_stages) tried by --sweep for paged_decode (with the default num_splits).
DECODE_SWEEP_CONFIGS: list[tuple[int, int, int]] = [(32, 4, 3), (64, 4, 2), (64, 8, 3), (128, 4, 3), (128, 8, 3)]


def _bench_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
    import triton.testing

    fn()  # compile / first-call work outside the timing
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    """Median time of `fn` replayed from a CUDA graph: the kernels alone, without Python launch overhead."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def _rate(amount: float, ms: float | None) -> float | None:
    """amount per second, in units of 1e12 (FLOP -> TFLOP/s) or 1e9 (bytes -> GB/s) as the caller scales."""
    return None if ms is None else amount / (ms * 1e-3)


def _try(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except Exception as e:  # a backend refusing a shape (or triton's OutOfResources) is a result, not a crash
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
        torch.cuda.empty_cache()
        return None


def _prefill_case(args: argparse.Namespace, dtype_name: str, d: int, t: int) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv = args.heads, args.kv_heads
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(t, hq, d, device=DEVICE, dtype=dtype, generator=gen)  # [T, Hq, D]
    k = torch.randn(t, hkv, d, device=DEVICE, dtype=dtype, generator=gen)  # [T, Hkv, D]
    v = torch.randn(t, hkv, d, device=DEVICE, dtype=dtype, generator=gen)
    tflop = 2 * 2 * t * t * hq * d / 2 / 1e12
    # [1, H, T, D] views: SDPA's fused backends want 4-d inputs
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    # K/V expanded to every query head with the flash backend forced: SDPA's best case
    ke = kh.repeat_interleave(hq // hkv, dim=1)  # [1, Hq, T, D]
    ve = vh.repeat_interleave(hq // hkv, dim=1)

    def sdpa_gqa() -> Tensor:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    def sdpa_flash() -> Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qh, ke, ve, is_causal=True)

    ms_sdpa = _try(lambda: _bench_ms(sdpa_gqa, args.warmup, args.rep))
    ms_flash = _try(lambda: _bench_ms(sdpa_flash, args.warmup, args.rep))
    ref = None
    if ms_flash is not None or ms_sdpa is not None:
        ref = (sdpa_flash() if ms_flash is not None else sdpa_gqa())[0].transpose(0, 1).float()  # [T, Hq, D]

    results: list[tuple[tuple[int, int, int, int] | None, float | None]] = []
    configs = FP32_SWEEP_CONFIGS if dtype == torch.float32 else SWEEP_CONFIGS
    for cfg in configs if args.sweep else [None]:
        kw = {} if cfg is None else dict(zip(("block_q", "block_k", "num_warps", "num_stages"), cfg, strict=True))
        fn = functools.partial(tri.attention_fwd, q, k, v, causal=True, **kw)
        results.append((cfg, _try(lambda fn=fn: _bench_ms(fn, args.warmup, args.rep))))
    done = [(cfg, ms) for cfg, ms in results if ms is not None]
    best_cfg, best_ms = min(done, key=lambda r: r[1]) if done else (None, None)
    default_ms = results[0][1]
    err = None
    if default_ms is not None and ref is not None:
        out, _ = tri.attention_fwd(q, k, v, causal=True)
        err = (out.float() - ref).abs().max().item()
    row: dict[str, Any] = {
        "dtype": dtype_name,
        "head_dim": d,
        "seqlen": t,
        "heads": hq,
        "kv_heads": hkv,
        "triton_ms": default_ms,
        "triton_tflops": _rate(tflop, default_ms),
        "triton_best_ms": best_ms,
        "triton_best_tflops": _rate(tflop, best_ms),
        "triton_best_config": None if best_cfg is None else list(best_cfg),
        "sdpa_gqa_ms": ms_sdpa,
        "sdpa_gqa_tflops": _rate(tflop, ms_sdpa),
        "sdpa_flash_expanded_ms": ms_flash,
        "sdpa_flash_expanded_tflops": _rate(tflop, ms_flash),
        "max_abs_err_vs_sdpa": err,
    }
    if args.sweep:
        row["sweep"] = [
            {"config": None if c is None else list(c), "ms": ms, "tflops": _rate(tflop, ms)} for c, ms in results
        ]
    return row


def bench_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtypes:
        for d in args.head_dims:
            for t in args.seqlens:
                rows.append(_prefill_case(args, dtype_name, d, t))
                print(_fmt_prefill(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    return rows


def _paged_cache(
    batch: int, ctx: int, hkv: int, d: int, page: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A cache holding `batch` sequences of `ctx` tokens in shuffled pages. Returns (k, v, table, seq_lens)."""
    pages_per_seq = math.ceil(ctx / page)
    num_blocks = batch * pages_per_seq
    k_cache = torch.randn(num_blocks, page, hkv, d, device=DEVICE, dtype=dtype)  # [blocks, page, Hkv, D]
    v_cache = torch.randn(num_blocks, page, hkv, d, device=DEVICE, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    table = perm.view(batch, pages_per_seq)  # [B, pages]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table, seq_lens


def _contiguous_kv(cache: Tensor, table: Tensor, ctx: int) -> Tensor:
    """The first `ctx` tokens of every row of `table`, stored contiguously: [B, Hkv, ctx, D]."""
    batch, (_, _, hkv, d) = table.shape[0], cache.shape
    return cache[table.long().flatten()].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()


def _decode_case(args: argparse.Namespace, dtype_name: str, ctx: int, batch: int) -> dict[str, Any] | None:
    hq, hkv, d = args.heads, args.kv_heads, args.decode_head_dim
    try:
        k_cache, v_cache, table, seq_lens = _paged_cache(batch, ctx, hkv, d, args.page_size, DTYPES[dtype_name])
    except torch.OutOfMemoryError:
        print(f"  decode {dtype_name} ctx={ctx} batch={batch}: out of memory, skipped", file=sys.stderr)
        return None
    q = torch.randn(batch, hq, d, device=DEVICE, dtype=k_cache.dtype)  # [B, Hq, D]
    kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
    kv_gb = kv_bytes / 1e9

    timed: list[tuple[int | None, float | None]] = []
    for splits in [None, *args.decode_splits]:
        fn = functools.partial(
            tri.paged_decode, q, k_cache, v_cache, table, seq_lens, num_splits=splits, max_seq_len=ctx
        )
        timed.append((splits, _try(lambda fn=fn: _bench_ms(fn, args.warmup, args.rep))))
    default_fn = functools.partial(tri.paged_decode, q, k_cache, v_cache, table, seq_lens, max_seq_len=ctx)
    ms_graph = _try(lambda: _graph_ms(default_fn, args.rep))
    swept: list[tuple[tuple[int, int, int], float | None]] = []
    for cfg in DECODE_SWEEP_CONFIGS if args.sweep else []:
        kw = dict(zip(("block_k", "num_warps", "num_stages"), cfg, strict=True))
        fn = functools.partial(tri.paged_decode, q, k_cache, v_cache, table, seq_lens, max_seq_len=ctx, **kw)
        swept.append((cfg, _try(lambda fn=fn: _bench_ms(fn, args.warmup, args.rep))))

    ms_sdpa, err = None, None
    if not args.no_decode_baseline:
        try:
            kc, vc = _contiguous_kv(k_cache, table, ctx), _contiguous_kv(v_cache, table, ctx)
        except torch.OutOfMemoryError:
            print("    contiguous baseline skipped: out of memory", file=sys.stderr)
        else:
            qs = q.unsqueeze(2)  # [B, Hq, 1, D]

            def sdpa() -> Tensor:
                return F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)

            ms_sdpa = _try(lambda: _bench_ms(sdpa, args.warmup, args.rep))
            if ms_sdpa is not None and timed[0][1] is not None:
                out, _ = tri.paged_decode(q, k_cache, v_cache, table, seq_lens)
                err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    row: dict[str, Any] = {
        "dtype": dtype_name,
        "head_dim": d,
        "context": ctx,
        "batch": batch,
        "heads": hq,
        "kv_heads": hkv,
        "page_size": args.page_size,
        "kv_bytes": kv_bytes,
        "triton_ms": timed[0][1],
        "triton_gbps": _rate(kv_gb, timed[0][1]),
        "triton_graph_ms": ms_graph,
        "triton_graph_gbps": _rate(kv_gb, ms_graph),
        "splits": [{"num_splits": s, "ms": ms, "gbps": _rate(kv_gb, ms)} for s, ms in timed],
        "sdpa_contiguous_ms": ms_sdpa,
        "sdpa_contiguous_gbps": _rate(kv_gb, ms_sdpa),
        "max_abs_err_vs_sdpa": err,
    }
    if args.sweep:
        row["sweep"] = [{"config": list(c), "ms": ms, "gbps": _rate(kv_gb, ms)} for c, ms in swept]
    return row


def bench_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtypes:
        for ctx in args.contexts:
            for batch in args.batches:
                row = _decode_case(args, dtype_name, ctx, batch)
                torch.cuda.empty_cache()
                if row is not None:
                    rows.append(row)
                    print(_fmt_decode(row), flush=True)
    return rows


def _f(x: float | None, spec: str = "8.1f") -> str:
    return f"{'-':>{spec.split('.')[0]}}" if x is None else format(x, spec)


def _fmt_prefill(r: dict[str, Any]) -> str:
    return (
        f"  prefill {r['dtype']:>4} D={r['head_dim']:<3} T={r['seqlen']:<6} "
        f"triton {_f(r['triton_tflops'])} TF/s (best {_f(r['triton_best_tflops'])})  "
        f"sdpa-gqa {_f(r['sdpa_gqa_tflops'])}  sdpa-flash {_f(r['sdpa_flash_expanded_tflops'])} TF/s  "
        f"err {_f(r['max_abs_err_vs_sdpa'], '8.1e')}"
    )


def _fmt_decode(r: dict[str, Any]) -> str:
    return (
        f"  decode  {r['dtype']:>4} ctx={r['context']:<7} B={r['batch']:<3} "
        f"triton {_f(r['triton_ms'], '8.3f')} ms {_f(r['triton_gbps'], '7.0f')} GB/s "
        f"graph {_f(r['triton_graph_gbps'], '7.0f')} GB/s  "
        f"sdpa-contiguous {_f(r['sdpa_contiguous_gbps'], '7.0f')} GB/s  err {_f(r['max_abs_err_vs_sdpa'], '8.1e')}"
        + _fmt_sweep_best(r.get("sweep"), "gbps", "GB/s")
    )


def _fmt_sweep_best(sweep: list[dict[str, Any]] | None, key: str, unit: str) -> str:
    done = [s for s in sweep or [] if s["ms"] is not None]
    if not done:
        return ""
    best = min(done, key=lambda s: s["ms"])
    return f"  sweep best {best['config']}: {best[key]:.1f} {unit}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_gpu.json")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="prefill head dims")
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="prefill lengths")
    p.add_argument("--sweep", action="store_true", help="also time other tile / launch configs, report the best")
    p.add_argument("--decode-head-dim", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072], help="decode context lengths")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--decode-splits", type=int, nargs="*", default=[], help="explicit num_splits to time as well")
    p.add_argument("--no-decode-baseline", action="store_true", help="skip the contiguous-SDPA decode baseline")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.contexts, args.batches = [4096], [8192], [1, 8]
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the benchmark must run compiled kernels")
    if not tri.available():
        sys.exit("bench_attention_gpu.py needs the `triton` package")
    import triton

    started = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if not args.skip_prefill:
        print(f"causal prefill, {args.heads} query / {args.kv_heads} KV heads (TFLOP/s, causal FLOPs)")
    prefill = [] if args.skip_prefill else bench_prefill(args)
    if not args.skip_decode:
        print(f"paged decode, {args.heads} query / {args.kv_heads} KV heads, page {args.page_size} (GB/s of K/V read)")
    decode = [] if args.skip_decode else bench_decode(args)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "elapsed_s": round(time.time() - started, 1),
        "prefill": prefill,
        "decode": decode,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
