"""KV-parallel decode attention on one GPU: what one holder's share costs, and what merging costs.

A KVP group of K instances splits a request's context into K ranges; every step each holder runs
`paged_decode` over its range (returning `(out, lse)`) and the master merges the K states. On one GPU this
measures the pieces (CUDA-graph replays, so launch overhead is out): the whole context in one `paged_decode`
(KVP 1) against one holder's `1/K` share and the K-way `merge_attn_states_many`. The step's attention with
KVP K is then roughly `share + merge` (holders run in parallel, each on its own GPU), plus the q / state
exchange this benchmark does not see. It also checks that the merged states equal the unsplit attention.

    python bench/bench_kvp_attention_gpu.py            # writes bench/results/kvp_attention_gpu.json

Not run on a GPU yet (the session that wrote it lost its GPU first); its logic ran on tiny shapes under
TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spindle_attention import triton as tri

DEVICE = "cuda"


def _graph_ms(fn, rep_ms: int) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def _case(ctx: int, batch: int, k: int, args: argparse.Namespace) -> dict:
    hq, hkv, d, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    dtype = torch.bfloat16
    pages = -(-ctx // page)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k_cache = torch.randn(batch * pages, page, hkv, d, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(batch * pages, page, hkv, d, device=DEVICE, dtype=dtype, generator=gen)
    table = torch.randperm(batch * pages, device=DEVICE, generator=gen).to(torch.int32).view(batch, pages)
    q = torch.randn(batch, hq, d, device=DEVICE, dtype=dtype, generator=gen)  # [B, Hq, D]
    full_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    # K contiguous token ranges, cut inside pages on purpose (not block-aligned)
    bounds = [ctx * j // k for j in range(k + 1)]
    shards = []
    for j in range(k):
        lo, hi = bounds[j], bounds[j + 1]
        # a shard's table starts at the page holding `lo`; its first `lo % page` slots are skipped by copying the
        # range into its own pages, as a holder stores only its range
        n = hi - lo
        sp = -(-n // page)
        kc = torch.empty(batch * sp, page, hkv, d, device=DEVICE, dtype=dtype)
        vc = torch.empty_like(kc)
        for b in range(batch):
            pos = torch.arange(lo, hi, device=DEVICE)
            src = table[b, pos // page].long() * page + pos % page
            dst = torch.arange(b * sp * page, b * sp * page + n, device=DEVICE)
            kc.view(-1, hkv, d)[dst] = k_cache.view(-1, hkv, d)[src]
            vc.view(-1, hkv, d)[dst] = v_cache.view(-1, hkv, d)[src]
        st = torch.arange(batch * sp, device=DEVICE, dtype=torch.int32).view(batch, sp)
        shards.append((kc, vc, st, torch.full((batch,), n, dtype=torch.int32, device=DEVICE), n))

    def full():
        return tri.paged_decode(q, k_cache, v_cache, table, full_lens, max_seq_len=ctx)

    kc0, vc0, st0, lens0, n0 = shards[0]

    def one_share():
        return tri.paged_decode(q, kc0, vc0, st0, lens0, max_seq_len=n0)

    states = [tri.paged_decode(q, kc, vc, st, lens, max_seq_len=n) for kc, vc, st, lens, n in shards]
    outs = torch.stack([o.float() for o, _ in states])  # [K, B, Hq, D]
    lses = torch.stack([lse for _, lse in states])  # [K, Hq, B]

    def merge():
        return tri.merge_attn_states_many(outs, lses, out_dtype=dtype)

    ref, _ = full()
    merged, _ = merge()
    err = (merged.float() - ref.float()).abs().max().item()
    full_ms = _graph_ms(full, args.rep)
    share_ms = _graph_ms(one_share, args.rep)
    merge_ms = _graph_ms(merge, args.rep) if k > 1 else 0.0
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    return {
        "context": ctx,
        "batch": batch,
        "kvp": k,
        "full_ms": full_ms,
        "share_ms": share_ms,
        "merge_ms": merge_ms,
        "kvp_step_attention_ms": share_ms + merge_ms,
        "speedup": full_ms / (share_ms + merge_ms),
        "full_gbps": kv_bytes / (full_ms * 1e-3) / 1e9,
        "max_abs_err_merged_vs_full": err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="131072,524288,1048576")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--degrees", default="1,2,4,8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph time per measurement, ms")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kvp_attention_gpu.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kvp_attention_gpu.py needs a CUDA GPU")
    rows = []
    print(f"device: {torch.cuda.get_device_name()}")
    print(
        f"{'context':>9} {'B':>2} {'kvp':>3} {'full ms':>8} {'share ms':>9} {'merge ms':>9} {'speedup':>8} {'err':>8}"
    )
    for ctx in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for k in (int(x) for x in args.degrees.split(",")):
                try:
                    r = _case(ctx, batch, k, args)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"{ctx:>9} {batch:>2} {k:>3}  out of memory, skipped")
                    continue
                torch.cuda.empty_cache()
                rows.append(r)
                print(
                    f"{ctx:>9} {batch:>2} {k:>3} {r['full_ms']:>8.3f} {r['share_ms']:>9.3f} {r['merge_ms']:>9.4f} "
                    f"{r['speedup']:>8.2f} {r['max_abs_err_merged_vs_full']:>8.1e}",
                    flush=True,
                )
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args) | {"out": str(args.out)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out | {"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
