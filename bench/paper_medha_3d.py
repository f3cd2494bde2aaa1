"""Medha's 3D parallelism (§5.4, Fig. 17/18) in the simulator: 2D (TP8 x SPP8, one replica) against 3D (TP8 x SPP4 x
KVP2, two replicas joined by KV parallelism) on the same 64 H100s, Llama-3-70B, ShareGPT4 with 5 % of 2M-token
requests (`medha-2m:0.05`), Poisson arrivals at the paper's loads.

    .venv/bin/python bench/paper_medha_3d.py            # table + bench/results/paper_medha_3d.json (a few minutes)
    .venv/bin/python bench/paper_medha_3d.py --quick    # 60 requests, two loads

- 2D: `medha` on one TP8-SPP8 replica (`spindle sim --spp 8`).
- 3D: `medha:kvp_tokens=1050000` on two TP8-SPP4 replicas (`--spp 4`): each replica holds at most 1.05M tokens of
  one request (the paper's "worker KV-cache token limit", which it does not state), so every 2M-token request
  spans both (KVP 2) and the short ones run on either. Replicas that share a request run their iterations
  together; each member's stages exchange queries with the other's (sim/iteration_side.py).
- Metrics: TTFT P50/P90/P99 (Fig. 17's distributions), TPOT P50/P90 (Fig. 18), the long requests' own TTFT, and
  each configuration's prefill and decode of one 2M-token request alone. The paper: TTFT about the same (3D's
  peak throughput slightly lower), TPOT over 2x lower with 3D at 1.75 QPS (P50 and P90).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from spindle_sim.executor import simulate
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.workloads import TraceRequest, make_workload

RESULTS = Path(__file__).parent / "results"
WORKLOAD, LONG = "medha-2m:0.05", 2_000_000
CONFIGS = {"2D (TP8-SPP8)": ("medha", 8), "3D (TP8-SPP4-KVP2)": ("medha:kvp_tokens=1050000", 4)}
RATES = (0.25, 0.75, 1.25, 1.75)


def run_one(name: str, rate: float | None, n: int, seed: int) -> dict[str, Any]:
    """One configuration at one load (`rate` None: one 2M-token request alone, 256 output tokens)."""
    spec, spp = CONFIGS[name]
    setup = named_cluster(
        ClusterSpec("h100-sxm", model="llama3-70b", nodes=8, decode_tp=8, spp=spp), True, elastic=True
    )
    trace = [TraceRequest(0.0, LONG, 256)] if rate is None else make_workload(WORKLOAD, n, rate, seed)
    t0 = time.perf_counter()
    result = simulate(trace, spec, setup.latency, setup.config)
    s = result.summary(WORKLOAD, rate or 0.0)
    long = [r for r in result.records if r.num_prefill_tokens >= LONG]
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in long if len(r.token_times) > 1]
    ttfts = [r.ttft for r in long if r.ttft is not None]
    return {
        "config": name, "spec": spec, "spp": spp, "rate": rate, "requests": len(trace), "shape": setup.shape.text,
        "completed": s.completed, "rejected": s.rejected, "failed": s.failed,
        "ttft_s": {"p50": s.ttft_s.p50, "p90": s.ttft_s.p90, "p99": s.ttft_s.p99},
        "tpot_s": {"p50": s.tpot_s.p50, "p90": s.tpot_s.p90},
        "long": {"count": len(long), "ttft_p50_s": float(np.median(ttfts)) if ttfts else None,
                 "tpot_p50_s": float(np.median(tpots)) if tpots else None,
                 "spans": sorted({len(r.prefill_instances) for r in long})},
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip


def evaluate(rates: tuple[float, ...], n: int, seed: int, jobs: int) -> list[dict[str, Any]]:
    tasks = [(name, rate, n, seed) for name in CONFIGS for rate in (None, *rates)]
    out = []
    with ProcessPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(tasks), desc="simulations") as bar:
        for f in as_completed([pool.submit(run_one, *t) for t in tasks]):
            out.append(f.result())
            bar.update()
    return sorted(out, key=lambda r: (r["rate"] or 0.0, r["config"]))


def table(runs: list[dict[str, Any]]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    head = "| load (QPS) | config | done | TTFT P50 / P90 / P99 (s) | TPOT P50 / P90 (ms) | 2M requests: TTFT P50 (s), "
    lines = [head + "TPOT P50 (ms) |", "|---|---|---|---|---|---|"]
    for r in runs:
        load = "one 2M request alone" if r["rate"] is None else f"{r['rate']}"
        t, p, lg = r["ttft_s"], r["tpot_s"], r["long"]
        lines.append(f"| {load} | {r['config']} | {r['completed']}/{r['requests']} | {s(t['p50'])} / {s(t['p90'])} / "
                     f"{s(t['p99'])} | {ms(p['p50'])} / {ms(p['p90'])} | {s(lg['ttft_p50_s'])}, "
                     f"{ms(lg['tpot_p50_s'])} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 requests at two loads (a smoke run)")
    parser.add_argument("--requests", type=int, default=200, help="requests per load (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/paper_medha_3d.json)")
    args = parser.parse_args()
    rates, n = ((0.25, 1.25), 60) if args.quick else (RATES, args.requests)
    runs = evaluate(rates, n, args.seed, args.jobs)
    print(table(runs))
    out = args.out or RESULTS / ("paper_medha_3d_quick.json" if args.quick else "paper_medha_3d.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": WORKLOAD, "configs": CONFIGS, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
