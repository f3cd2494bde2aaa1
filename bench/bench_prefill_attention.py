"""Chunked-prefill attention on CPU: Spindle's native kernel (`spindle_attention.cpu.prefill`) against PyTorch's
CPU flash attention as the engine used it before (`paged._history_then_chunk`: the history unmasked and the chunk
causal, merged by LSE), same inputs, same threads, same run.

    .venv/bin/python bench/bench_prefill_attention.py                   # table + bench/results/prefill_attention.json
    .venv/bin/python bench/bench_prefill_attention.py --threads 1,4,16 --out $OUT/prefill_attention.json

Cases: a whole 3,000-token prompt and chunks after a history (2,048 after 6,144; 4,096 after 12,288), SmolLM2's
9 query / 3 KV heads, head dim 64 and 128, fp32. GFLOP/s count the causal work only (QK^T and PV over the keys each
query sees). Each case also reports the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spindle_attention import cpu
from spindle_attention.paged import _history_then_chunk

HQ, HKV = 9, 3
CASES = ((3000, 3000), (8192, 2048), (16384, 4096))  # (tokens cached after the chunk, chunk)


def best_of(fn: Any, repeats: int) -> float:
    fn()  # warm-up: the kernel library loads, caches fill
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="", help="comma-separated thread counts (default: torch's)")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_attention.json")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the native CPU kernels are not available here (AVX-512 and a C compiler are needed)")
    threads = [int(x) for x in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    dims = [int(x) for x in args.head_dims.split(",")]
    rows = []
    with tqdm(total=len(dims) * len(CASES) * len(threads), desc="cases") as bar:
        for d in dims:
            for total, n in CASES:
                history = total - n
                g = torch.Generator().manual_seed(0)
                q = torch.randn(n, HQ, d, generator=g)  # [tokens, heads, head_dim]
                k = torch.randn(total, HKV, d, generator=g)
                v = torch.randn(total, HKV, d, generator=g)
                table = torch.zeros(1, dtype=torch.int64)  # contiguous K/V: one block of `total` tokens
                scale = d**-0.5

                def torch_path() -> tuple[torch.Tensor, torch.Tensor]:
                    return _history_then_chunk(q, k, v, history, scale)  # noqa: B023

                def native() -> tuple[torch.Tensor, torch.Tensor]:
                    return cpu.prefill.attention(q, k.unsqueeze(0), v.unsqueeze(0), table, history, scale)  # noqa: B023

                diff = (native()[0] - torch_path()[0]).abs().max().item()
                flops = HQ * 4 * d * (n * history + n * n / 2)
                for th in threads:
                    torch.set_num_threads(th)
                    t_torch, t_native = best_of(torch_path, args.repeats), best_of(native, args.repeats)
                    rows.append({
                        "head_dim": d, "tokens": total, "chunk": n, "threads": th, "max_abs_diff": diff,
                        "torch_s": t_torch, "native_s": t_native, "torch_gflops": flops / t_torch / 1e9,
                        "native_gflops": flops / t_native / 1e9, "speedup": t_torch / t_native,
                    })  # fmt: skip
                    bar.update()
    print(f"{'D':>4} {'tokens':>7} {'chunk':>6} {'threads':>7} {'torch GF/s':>10} {'native GF/s':>11} {'ratio':>6} "
          f"{'max diff':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['head_dim']:>4} {r['tokens']:>7} {r['chunk']:>6} {r['threads']:>7} {r['torch_gflops']:>10.0f} "
              f"{r['native_gflops']:>11.0f} {r['speedup']:>6.2f} {r['max_abs_diff']:>9.1e}")  # fmt: skip
    doc = {
        "benchmark": "chunked-prefill attention: native CPU kernel vs torch CPU flash attention",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "heads": {"q": HQ, "kv": HKV}, "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
