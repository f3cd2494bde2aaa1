"""Sequence-parallel attention on one GPU: each rank's local compute, and its share of a ring / all-to-all step.

One GPU cannot run a real SP group, so this replays, rank by rank, exactly the local work each rank of an
SP group does (the same `local_attention` + `merge_attn_states` calls `ring_attention` and
`ulysses_attention` make: the Triton kernel on CUDA) and times every piece with CUDA events. The
communication is not run; its time is the bytes the real paths move (the same formulas their `CommStats`
record) over an assumed link bandwidth (`--link-gbps`, default 450 GB/s: H100 SXM NVLink, one direction).

- ring (contiguous / stripe / zigzag): in step s rank r attends its queries to the KV block that started
  on rank (r - s) % sp while the next block travels one hop, so a step lasts
  max(slowest rank's compute, block transfer). Local-compute share = sum of compute / sum of step times.
- ulysses: all-to-all of q/k/v to head shards, local attention over the whole chunk, all-to-all back (no
  overlap): share = compute / (compute + both all-to-alls).
- peer: the whole chunk in one `attention_fwd` call on the same GPU (TFLOP/s, causal FLOPs).

    python bench/bench_sp_attention_gpu.py                  # writes bench/results/sp_attention_gpu.json
    python bench/bench_sp_attention_gpu.py --smoke          # tiny shapes on CPU (torch path), checks the logic
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spindle_attention import merge_attn_states
from spindle_attention.distributed import shard_positions
from spindle_attention.distributed.local import local_attention
from spindle_attention.distributed.ulysses import head_split

RING_LAYOUTS = ("contiguous", "stripe", "zigzag")


def _time_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, wall clock on CPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ring_case(q, k, v, whole: torch.Tensor, sp: int, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    dev, scale = q.device, 1.0 / math.sqrt(d)
    pos = [shard_positions(t, sp, layout, r).to(dev) for r in range(sp)]
    qs = [q.index_select(0, p) for p in pos]
    ks = [k.index_select(0, p) for p in pos]
    vs = [v.index_select(0, p) for p in pos]
    token_bytes = 8 + 2 * hkv * d * q.element_size()  # what one token of a block costs on the wire
    compute = [[0.0] * sp for _ in range(sp)]  # [step][rank] ms
    err = 0.0
    for r in range(sp):
        out = torch.zeros(qs[r].shape, dtype=torch.float32, device=dev)
        lse = torch.full((hq, qs[r].shape[0]), float("-inf"), dtype=torch.float32, device=dev)
        q_max = int(pos[r].max())
        for s in range(sp):
            src = (r - s) % sp
            if int(pos[src].min()) > q_max:  # ring_attention skips blocks wholly in the queries' future
                continue

            def step(r: int = r, src: int = src, out: torch.Tensor = out, lse: torch.Tensor = lse):
                o, l_ = local_attention(
                    qs[r], ks[src], vs[src], q_positions=pos[r], k_positions=pos[src], softmax_scale=scale
                )
                return merge_attn_states(out, lse, o.float(), l_)

            compute[s][r] = _time_ms(step, dev, args.reps)
            out, lse = step()
        err = max(err, (out - whole.index_select(0, pos[r]).float()).abs().max().item())
    steps = []
    for s in range(sp):
        # rank r sends block (r - s) % sp during step s (none in the last step)
        send_ms = (
            0.0
            if s == sp - 1
            else max(len(pos[(r - s) % sp]) for r in range(sp)) * token_bytes / (args.link_gbps * 1e6)
        )
        steps.append({"compute_ms": max(compute[s]), "transfer_ms": send_ms, "step_ms": max(max(compute[s]), send_ms)})
    total_compute = [sum(compute[s][r] for s in range(sp)) for r in range(sp)]
    sum_steps = sum(x["step_ms"] for x in steps)
    return {
        "method": f"ring-{layout}",
        "sp": sp,
        "rank_compute_ms": total_compute,
        "balance": max(total_compute) / statistics.mean(total_compute) if sum(total_compute) else 1.0,
        "steps": steps,
        "time_ms": sum_steps,
        "compute_share": sum(x["compute_ms"] for x in steps) / sum_steps if sum_steps else 1.0,
        "max_abs_err_vs_whole": err,
        "bytes_per_rank": max(sum(len(pos[(r - s) % sp]) for s in range(sp - 1)) for r in range(sp)) * token_bytes,
    }


def _ulysses_case(q, k, v, sp: int, args: argparse.Namespace) -> dict[str, Any]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    dev, scale = q.device, 1.0 / math.sqrt(d)
    group = hq // hkv
    pos = torch.arange(t, device=dev)
    compute = []
    for (qs, qe), (ks, ke) in head_split(hq, hkv, sp):
        if qe == qs:
            compute.append(0.0)
            continue
        qh = q[:, qs:qe].contiguous()
        kh, vh = k[:, ks:ke].contiguous(), v[:, ks:ke].contiguous()
        if not (qs % group == 0 and (qe - qs) % group == 0):  # a partial group: each query head its own KV head
            idx = torch.tensor([h // group - ks for h in range(qs, qe)], device=dev)
            kh, vh = kh.index_select(1, idx), vh.index_select(1, idx)
        compute.append(
            _time_ms(
                lambda qh=qh, kh=kh, vh=vh: local_attention(
                    qh, kh, vh, q_positions=pos, k_positions=pos, softmax_scale=scale
                ),
                dev,
                args.reps,
            )
        )
    # per rank: its token shard of q/k/v out to the others, and the others' outputs for its tokens back
    n = math.ceil(t / sp)
    elem = q.element_size()
    a2a_in = n * (hq + 2 * hkv) * d * elem * (sp - 1) / sp
    a2a_out = n * hq * d * elem * (sp - 1) / sp
    comm_ms = (a2a_in + a2a_out) / (args.link_gbps * 1e6)
    slowest = max(compute)
    return {
        "method": "ulysses",
        "sp": sp,
        "rank_compute_ms": compute,
        "balance": slowest / statistics.mean(compute),
        "time_ms": slowest + comm_ms,
        "transfer_ms": comm_ms,
        "compute_share": slowest / (slowest + comm_ms),
        "bytes_per_rank": int(a2a_in + a2a_out),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows = []
    for t in args.tokens:
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(t, args.heads, args.head_dim, device=dev, dtype=dtype, generator=gen)  # [T, Hq, D]
        k = torch.randn(t, args.kv_heads, args.head_dim, device=dev, dtype=dtype, generator=gen)  # [T, Hkv, D]
        v = torch.randn(t, args.kv_heads, args.head_dim, device=dev, dtype=dtype, generator=gen)
        pos = torch.arange(t, device=dev)
        scale = 1.0 / math.sqrt(args.head_dim)
        whole = functools.partial(local_attention, q, k, v, q_positions=pos, k_positions=pos, softmax_scale=scale)
        whole_ms = _time_ms(whole, dev, args.reps)
        whole_out = whole()[0]
        tflop = 2 * 2 * t * t * args.heads * args.head_dim / 2 / 1e12
        peer = {"tokens": t, "whole_ms": whole_ms, "whole_tflops": tflop / (whole_ms * 1e-3)}
        print(f"T={t}: one GPU, whole chunk: {whole_ms:.2f} ms ({peer['whole_tflops']:.0f} TFLOP/s)", flush=True)
        for sp in args.sp:
            cases = [_ring_case(q, k, v, whole_out, sp, layout, args) for layout in RING_LAYOUTS]
            cases.append(_ulysses_case(q, k, v, sp, args))
            for c in cases:
                c["tokens"] = t
                c["speedup_vs_whole"] = whole_ms / c["time_ms"]
                rows.append(c)
                print(
                    f"  sp={sp} {c['method']:<16} time {c['time_ms']:9.2f} ms  compute share {c['compute_share']:6.1%}"
                    f"  balance {c['balance']:5.2f}  speed-up vs 1 GPU {c['speedup_vs_whole']:5.2f}x"
                    f"  sent/rank {c['bytes_per_rank'] / 1e6:9.1f} MB  err {c.get('max_abs_err_vs_whole', 0.0):.1e}",
                    flush=True,
                )
        rows.append({"method": "whole", **peer})
    return {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "link_gbps_assumed": args.link_gbps,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072], help="chunk lengths")
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8], help="SP sizes")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--link-gbps", type=float, default=450.0, help="assumed per-direction link bandwidth, GB/s")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with the torch path")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sp_attention_gpu.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.tokens, args.sp, args.heads, args.kv_heads, args.head_dim = "cpu", [301], [2, 3], 9, 3, 16
        args.dtype, args.reps = "fp32", 1
    elif not torch.cuda.is_available():
        sys.exit("bench_sp_attention_gpu.py needs a CUDA GPU (or --smoke)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
