"""Sequence-parallel attention on a real local gloo group: time, balance and bytes moved per SP size and layout.

    .venv/bin/python bench/bench_sp_attention.py [--tokens 4096] [--sp 1,2,3,4] [--repeats 3]

For each SP size and each method (ring with the contiguous / stripe / zigzag layout, Ulysses all-to-all), every
rank runs causal attention over its shard of one chunk (SmolLM2's 9 query / 3 KV heads, head dim 64, fp32) and
records its wall time, its local-compute and communication-wait time, and the bytes it sent against the
theoretical payload. The peer in the same run is `attention_fwd` on the whole chunk in one process.

On this 2-core machine SP > 2 oversubscribes the cores, so wall times show overheads, not speed-ups; what
the numbers do show is the causal load balance of each layout (the slowest rank's compute vs the mean) and
that the bytes moved equal the theoretical volume. Writes bench/results/sp_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spindle_attention import attention_fwd
from spindle_attention.distributed import CommStats, ring_attention, shard, shard_positions, ulysses_attention
from spindle_attention.distributed.testing import run_group

HQ, HKV, D = 9, 3, 64
METHODS = ("ring-contiguous", "ring-stripe", "ring-zigzag", "ulysses")


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, HQ, D, generator=g)  # [tokens, heads, head_dim]
    k = torch.randn(n, HKV, D, generator=g)
    v = torch.randn(n, HKV, D, generator=g)
    return q, k, v


def _rank(rank: int, sp: int, n: int, repeats: int, out_dir: str) -> None:
    q, k, v = _inputs(n)
    rows = {}
    for method in METHODS:
        layout = method.split("-")[1] if method.startswith("ring") else "contiguous"
        pos = shard_positions(n, sp, layout, rank)
        qs, ks, vs = (shard(t, sp, layout, rank) for t in (q, k, v))
        fn = ring_attention if method.startswith("ring") else ulysses_attention
        walls, stats = [], None
        for _ in range(repeats + 1):  # the first call warms up
            torch.distributed.barrier()
            stats = CommStats()
            t0 = time.perf_counter()
            fn(qs, ks, vs, q_positions=pos, k_positions=pos, stats=stats)
            walls.append(time.perf_counter() - t0)
        assert stats is not None
        rows[method] = {
            "wall_s": statistics.median(walls[1:]),
            "compute_s": stats.compute_s,
            "wait_s": stats.wait_s,
            "bytes_sent": stats.bytes_sent,
            "payload_bytes": sum(stats.step_payload_bytes),
            "meta_bytes": stats.meta_bytes,
            "step_bytes": stats.step_bytes_sent,
            "tokens": int(pos.numel()),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="chunk length (default: %(default)s)")
    p.add_argument("--sp", default="1,2,3,4", help="SP sizes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/sp_attention.json"))
    a = p.parse_args()
    sizes = [int(s) for s in a.sp.split(",")]
    torch.set_num_threads(1)
    q, k, v = _inputs(a.tokens)
    walls = []
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        attention_fwd(q, k, v)
        walls.append(time.perf_counter() - t0)
    single = statistics.median(walls[1:])
    results: dict = {"tokens": a.tokens, "heads": [HQ, HKV, D], "single_process_s": single, "sp": {}}
    print(f"{a.tokens} tokens, {HQ}/{HKV} heads, head dim {D}, fp32; one process, 1 thread: {single * 1e3:.1f} ms")
    print(
        f"{'sp':>3} {'method':16} {'wall ms':>9} {'vs 1 proc':>9} {'max/mean compute':>17} {'MB sent/rank':>13} "
        f"{'payload MB':>11} {'overhead B':>11}"
    )
    for sp in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            run_group(_rank, sp, a.tokens, a.repeats, tmp, timeout=600)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(sp)]
        results["sp"][sp] = {m: [r[m] for r in ranks] for m in METHODS}
        for m in METHODS:
            per = [r[m] for r in ranks]
            wall = max(x["wall_s"] for x in per)
            comp = [x["compute_s"] for x in per]
            balance = max(comp) / statistics.mean(comp) if statistics.mean(comp) > 0 else float("nan")
            sent = statistics.mean(x["bytes_sent"] for x in per)
            payload = statistics.mean(x["payload_bytes"] for x in per)
            print(
                f"{sp:>3} {m:16} {wall * 1e3:9.1f} {wall / single:9.2f} {balance:17.2f} {sent / 1e6:13.3f} "
                f"{payload / 1e6:11.3f} {sent - payload:11.0f}"
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
