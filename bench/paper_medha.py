"""Medha's evaluation (§5.2, §5.4) in the simulator: its cluster, workload, baselines and metrics.

    python bench/paper_medha.py           # bench/results/paper_medha.{json,png}
    python bench/paper_medha.py --quick   # fewer requests and rates: a smoke run (bench/results/paper_medha_quick.*)

- Cluster (§5.1-5.2): Llama-3-8B on two DGX-A100 servers (16 A100-80G). Medha runs TP8-SPP2 there, one replica of 16
  GPUs: `Medha (TP8-SPP2)` (the simulator pipelines an iteration over the stages when it samples nothing, see
  sim/iteration_side.py), and `Medha (TP8-SPP2, overlap)` (decodes in one micro-batch per stage, so every iteration
  overlaps: `medha:spp_overlap=1`, a schedule for an engine that samples asynchronously); `Medha` and its scheduler
  ablations get the same 16 GPUs as two TP8 replicas behind its KVP load balancer. Sarathi (vLLM's scheduler past 32K
  tokens) runs TP8-PP2 as in the paper: `chunked` (FCFS chunked prefill) with 512- and 2048-token chunks on one TP8-SPP2
  colocated instance (the simulator pipelines its iterations that sample nothing, as Medha's), and, as a variant, on
  two TP8 instances (`Sarathi (2048, 2 x TP8)`), the shape of `Medha`. LoongServe (TP2, CP4): `loongserve` on 8
  elastic TP2 instances.
- Workloads: ShareGPT4-like short requests (`medha-mix:0`) and the same with 5 % long requests of 128K-1M tokens
  (`medha-mix:0.05`, Medha-SWE's P50 393K / P90 839K prompt and 518 / 808 output tokens); Poisson arrivals at
  0.25-1.75 QPS as Fig. 15/16.
- Metrics: TTFT and TPOT (P50, P90) per load (Fig. 15/16), and the long requests' own median TTFT (what EDF gives
  up: Fig. 22's tail); the active requests over time at 1.25 QPS (Fig. 21);
  the scheduler ablation (Fig. 22: FCFS, EDF, LRS and Medha's ILRS with prefill-prefill batching, all on Medha's
  mechanisms); capacity: the highest of the loads whose P90 TTFT stays under 10 s (short requests not held
  behind long ones: the long 5 % are past the P90). Headlines as the paper's:
  LoongServe's median TTFT over Medha's at 0.75 QPS with 5 % long requests (paper: 30x), capacity ratio (paper:
  up to 5x), and Medha's TTFT against LRS's (paper: LRS up to 1.8x Medha's median).
- Deadlines (the paper does not state them): `medha`'s default rule, 0.25 s + 3x the prompt's prefill time alone;
  the sensitivity to the factor (1.5x, 3x, 6x) is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from spindle_sim.executor import simulate
from spindle_sim.metrics import strict_json
from spindle_sim.named_cluster import ClusterSpec, SimSetup, named_cluster
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"
MODEL, HARDWARE, NODES = "llama3-8b", "a100-80g", 2
MEDHA, FCFS, LRS, EDF = "Medha", "Medha-FCFS", "Medha-LRS", "Medha-EDF"
MEDHA_SPP = "Medha (TP8-SPP2)"
MEDHA_OVERLAP = "Medha (TP8-SPP2, overlap)"
S512, S2048, LS = "Sarathi (512)", "Sarathi (2048)", "LoongServe (TP2)"
S512_TP8, S2048_TP8 = "Sarathi (512, 2 x TP8)", "Sarathi (2048, 2 x TP8)"
SARATHI = (S512, S2048, S512_TP8, S2048_TP8)
SYSTEMS = {  # paper name -> (strategy spec, cluster kind)
    MEDHA: ("medha", "tp8"),
    MEDHA_SPP: ("medha", "tp8spp2"),
    MEDHA_OVERLAP: ("medha:spp_overlap=1", "tp8spp2"),
    FCFS: ("medha:policy=fcfs", "tp8"),
    LRS: ("medha:policy=lrs", "tp8"),
    EDF: ("medha:policy=edf", "tp8"),
    S512: ("chunked:chunk_size=512", "tp8spp2"),
    S2048: ("chunked:chunk_size=2048", "tp8spp2"),
    S512_TP8: ("chunked:chunk_size=512", "tp8"),
    S2048_TP8: ("chunked:chunk_size=2048", "tp8"),
    LS: ("loongserve", "tp2"),
}
WORKLOADS = {"ShareGPT4": "medha-mix:0", "ShareGPT4 + 5% long": "medha-mix:0.05"}
RATES = (0.25, 0.75, 1.25, 1.75, 2.5)  # the paper's loads, and one past them to bound Medha's capacity
CAPACITY_TTFT_S = 10.0
SENSITIVITY = (1.5, 3.0, 6.0)
LONG_TOKENS = 128_000  # the long requests' own TTFT (past every percentile the table shows at 5 %)


def cluster(kind: str) -> SimSetup:
    """16 A100s as two TP8 colocated instances (`tp8`), one TP8-SPP2 (`tp8spp2`) or eight TP2 elastic ones (`tp2`)."""
    tp = 2 if kind == "tp2" else 8
    spec = ClusterSpec(HARDWARE, model=MODEL, nodes=NODES, decode_tp=tp, spp=2 if kind == "tp8spp2" else None)
    setup = named_cluster(spec, True, elastic=True)
    return setup


def run_one(system: str, spec: str, kind: str, workload: str, rate: float, n: int, seed: int) -> dict[str, Any]:
    setup = cluster(kind)
    trace = make_workload(workload, n, rate, seed)
    t0 = time.perf_counter()
    result = simulate(trace, spec, setup.latency, setup.config)
    s = result.summary(workload, rate)
    long_ttfts = [r.ttft for r in result.records if r.num_prefill_tokens >= LONG_TOKENS and r.ttft is not None]
    active = []
    if rate == 1.25:  # Fig. 21: requests in the system (queued included) every 10 s of the run
        ends = [r.finished_at if r.finished_at is not None else math.inf for r in result.records]
        starts = [r.arrived_at for r in result.records]
        for t in np.arange(0.0, max(starts) + 60.0, 10.0):
            active.append([float(t), int(sum(1 for a, e in zip(starts, ends, strict=True) if a <= t < e))])
    return {
        "system": system, "spec": spec, "workload": workload, "rate": rate, "requests": n,
        "completed": s.completed, "rejected": s.rejected, "failed": s.failed,
        "ttft_s": {"p50": s.ttft_s.p50, "p90": s.ttft_s.p90, "mean": s.ttft_s.mean},
        "tpot_s": {"p50": s.tpot_s.p50, "p90": s.tpot_s.p90, "mean": s.tpot_s.mean},
        "long_ttft_s": {"p50": float(np.median(long_ttfts)) if long_ttfts else None,
                        "max": max(long_ttfts, default=None), "count": len(long_ttfts)},
        "active": active, "wall_s": time.perf_counter() - t0, "shape": setup.shape.text,
    }  # fmt: skip


def capacity(runs: list[dict[str, Any]]) -> float | None:
    """The highest load whose P90 TTFT stays under CAPACITY_TTFT_S with every request done (None: none does)."""
    ok = [r["rate"] for r in runs if r["completed"] == r["requests"] and r["ttft_s"]["p90"] <= CAPACITY_TTFT_S]
    return max(ok) if ok else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 and math.isfinite(a) else None


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    rates = RATES[1::2] if args.quick else RATES
    n = 60 if args.quick else args.requests
    tasks: dict[tuple[str, str, float], tuple[Any, ...]] = {}
    for wname, workload in WORKLOADS.items():
        for system, (spec, kind) in SYSTEMS.items():
            if wname == "ShareGPT4" and system in (FCFS, LRS, EDF):
                continue  # the ablation is on the mixed workload (Fig. 22)
            for rate in rates:
                tasks[(wname, system, rate)] = (system, spec, kind, workload, rate, n, args.seed)
    mixed = WORKLOADS["ShareGPT4 + 5% long"]
    for factor in SENSITIVITY:
        tasks[("sensitivity", f"ttft_factor={factor}", 1.25)] = (
            MEDHA,
            f"medha:ttft_factor={factor}",
            "tp8",
            mixed,
            1.25,
            n,
            args.seed,
        )
    out: dict[tuple[str, str, float], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool, tqdm(total=len(tasks), desc="simulations") as bar:
        futures = {pool.submit(run_one, *a): key for key, a in tasks.items()}
        for f in as_completed(futures):
            key = futures[f]
            try:
                out[key] = f.result()
            except Exception as e:  # a crashing strategy is reported, the rest goes on
                out[key] = {"error": f"{type(e).__name__}: {e}"}
            bar.update()
    results: dict[str, Any] = {"workloads": {}, "sensitivity": {}}
    for (wname, system, _rate), r in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if wname == "sensitivity":
            results["sensitivity"][system] = r
        else:
            results["workloads"].setdefault(wname, {}).setdefault(system, []).append(r)
    return results


def headlines(results: dict[str, Any]) -> list[dict[str, Any]]:
    mixed = results["workloads"]["ShareGPT4 + 5% long"]

    def at(system: str, rate: float, key: str = "ttft_s", q: str = "p50") -> float | None:
        r = next((x for x in mixed.get(system, []) if x.get("rate") == rate), None)
        return None if r is None or "error" in r else r[key][q]

    caps = {s: capacity([r for r in runs if "error" not in r]) for s, runs in mixed.items()}
    best_base = max((caps[s] or 0.0 for s in (*SARATHI, LS, FCFS) if s in caps), default=0.0)
    return [
        {"what": "median TTFT, LoongServe / Medha, 5 % long, 0.75 QPS (Fig. 15b)", "paper": 30.0,
         "spindle": ratio(at(LS, 0.75), at(MEDHA, 0.75))},
        {"what": "median TTFT, LoongServe / Medha (TP8-SPP2, the paper's replica), 5 % long, 0.75 QPS (Fig. 15b)",
         "paper": 30.0, "spindle": ratio(at(LS, 0.75), at(MEDHA_SPP, 0.75))},
        {"what": "median TTFT, LoongServe / Medha (TP8-SPP2, overlap), 5 % long, 0.75 QPS (Fig. 15b)", "paper": 30.0,
         "spindle": ratio(at(LS, 0.75), at(MEDHA_OVERLAP, 0.75))},
        {"what": "long requests' median TTFT, Medha (2 x TP8) / Medha (TP8-SPP2), 5 % long, 0.75 QPS", "paper": None,
         "spindle": ratio(at(MEDHA, 0.75, "long_ttft_s"), at(MEDHA_SPP, 0.75, "long_ttft_s"))},
        {"what": "long requests' median TTFT, Medha (2 x TP8) / Medha (TP8-SPP2, overlap), 5 % long, 0.75 QPS",
         "paper": None, "spindle": ratio(at(MEDHA, 0.75, "long_ttft_s"), at(MEDHA_OVERLAP, 0.75, "long_ttft_s"))},
        {"what": "capacity (P90 TTFT <= 10 s), Medha / best baseline, 5 % long", "paper": 5.0,
         "spindle": ratio(caps.get(MEDHA), best_base or None), "capacities": caps,
         "note": "a capacity at the highest load is a lower bound; None: the rule fails at every load"},
        {"what": "median TTFT, LRS / Medha, 5 % long, 1.75 QPS (Fig. 22)", "paper": 1.8,
         "spindle": ratio(at(LRS, 1.75), at(MEDHA, 1.75))},
        {"what": "P90 TPOT, Sarathi (2048, TP8-PP2) / Medha, 5 % long, 1.25 QPS (Fig. 16b)", "paper": None,
         "spindle": ratio(at(S2048, 1.25, "tpot_s", "p90"), at(MEDHA, 1.25, "tpot_s", "p90"))},
        {"what": "P90 TPOT, Sarathi (2048, 2 x TP8) / Medha, 5 % long, 1.25 QPS (Fig. 16b)", "paper": None,
         "spindle": ratio(at(S2048_TP8, 1.25, "tpot_s", "p90"), at(MEDHA, 1.25, "tpot_s", "p90"))},
    ]  # fmt: skip


def _f(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}"


def table(results: dict[str, Any]) -> str:
    lines = []
    for wname, systems in results["workloads"].items():
        lines.append(
            f"\n{wname}: P50 / P90 TTFT (s), P50 / P90 TPOT (ms), the long requests' median TTFT (s) "
            "per load (QPS); done/all"
        )
        for system, runs in systems.items():
            cells = []
            for r in runs:
                if "error" in r:
                    cells.append(f"{r.get('rate', '?')}: error")
                    continue
                cells.append(f"{r['rate']}: {_f(r['ttft_s']['p50'])}/{_f(r['ttft_s']['p90'])} s, "
                             f"{_f(1e3 * r['tpot_s']['p50'])}/{_f(1e3 * r['tpot_s']['p90'])} ms, "
                             f"long {_f(r['long_ttft_s']['p50'])} s, {r['completed']}/{r['requests']}")  # fmt: skip
            lines.append(f"  {system:18s} " + " | ".join(cells))
    lines.append("\nTTFT-deadline sensitivity (medha at 1.25 QPS, 5 % long): P50 / P90 TTFT (s)")
    for name, r in results["sensitivity"].items():
        if "error" not in r:
            lines.append(f"  {name:18s} {_f(r['ttft_s']['p50'])} / {_f(r['ttft_s']['p90'])}")
    lines.append("\nheadlines (paper vs Spindle):")
    for h in results["headlines"]:
        lines.append(f"  {h['what']}: paper {_f(h['paper'])}, Spindle {_f(h['spindle'])}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = results["workloads"]["ShareGPT4 + 5% long"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = ((axes[0][0], "ttft_s", "p50", "median TTFT (s)"), (axes[0][1], "ttft_s", "p90", "P90 TTFT (s)"),
              (axes[1][0], "tpot_s", "p90", "P90 TPOT (s)"))  # fmt: skip
    for ax, key, q, label in panels:
        for system, runs in mixed.items():
            pts = [(r["rate"], r[key][q]) for r in runs if "error" not in r and math.isfinite(r[key][q])]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.set_xlabel("load (QPS)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    ax = axes[1][1]
    for system in (MEDHA, LS):
        r = next((x for x in mixed.get(system, []) if x.get("rate") == 1.25 and x.get("active")), None)
        if r is not None:
            ax.plot(*zip(*r["active"], strict=True), label=system)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("active requests (Fig. 21, 1.25 QPS)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("Medha §5 in Spindle's simulator: Llama-3-8B on 16 A100s, ShareGPT4 + 5 % long requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 requests, two loads: a smoke run")
    parser.add_argument("--requests", type=int, default=300, help="requests per simulation (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations at once")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/paper_medha.json)")
    args = parser.parse_args()
    out = args.out or RESULTS / ("paper_medha_quick.json" if args.quick else "paper_medha.json")
    t0 = time.perf_counter()
    results = evaluate(args)
    results["headlines"] = headlines(results)
    results["setup"] = {
        "model": MODEL, "hardware": HARDWARE, "nodes": NODES, "systems": {k: v[0] for k, v in SYSTEMS.items()},
        "workloads": WORKLOADS, "rates": list(RATES), "requests": 60 if args.quick else args.requests,
        "seed": args.seed, "capacity_rule": f"P90 TTFT <= {CAPACITY_TTFT_S} s, every request done",
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(strict_json(results), indent=1))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
