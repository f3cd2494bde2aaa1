"""Tetris's evaluation (§7) in the simulator: its cluster, workloads, baselines, metrics and SLO rule.

    python bench/paper_tetris.py            # bench/results/paper_tetris.{json,png}, paper_tetris_ablation.png
    python bench/paper_tetris.py --quick    # fewer requests and rates (a smoke run)

- Cluster (§7.1): Llama-3-8B on 32 A100s at P/D 1:1, Table 1's latencies (Eq. 1 fitted): 16 prefill instances
  (2 nodes of 8) + 2 decode instances of TP 8, the headline; twice that (32 prefill + 4 decode, 64 GPUs) as a
  variant (`8b ... 32+4` runs). Llama-3-70B (§7.2): the cost model's A100-80G at TP 4 per prefill
  instance, 8 prefill instances (32 GPUs) + 4 decode instances of TP 8, the medium workload; its improvement-rate
  table is tuned first on that cluster (`spindle tune tetris`'s search; the shipped tables are the 8B cluster's).
- Workloads: the paper's short / medium / long length distributions, Poisson arrivals, 1,000 requests a point.
- Strategies, named as the paper names them: Fixed SP=16 and Fixed SP=8 (`fixed-sp`), LoongServe
  Disaggregated (`request-sp`: per-request SP size on the prefill pool), Tetris (`tetris` with the workload's
  shipped improvement-rate table), Tetris single-chunk (`tetris:chunking=0`, Fig. 13), Tetris at fixed
  improvement rates 0.1 / 0.3 / 0.5 / 0.7 (Fig. 11).
- Headlines: P50 / P99 TTFT of the best baseline over Tetris's (max over the rates at which both Tetris and
  the best baseline hold their SLO, per workload; the paper's ranges are over its workloads); max sustainable
  load of Tetris over the best baseline's: the highest rate whose P50 TTFT stays under one SLO shared by every
  strategy of the run (25x the lowest light-load P50 TTFT among them), each probed rate offering its load for
  at least 120 s; single-chunk over CDSP P50 / P99 TTFT (max over the rates Tetris sustains); Fig. 11's TTFT at
  fixed rates relative to the dynamic choice.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spindle_policy.calibration import load_paper_calibration
from spindle_policy.core import SchedulerConfig
from spindle_policy.latency import LatencyModel
from spindle_sim import SimConfig
from spindle_sim.loadsearch import Probe, light_load, max_sustainable_load
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.sweep import SweepRow, sweep
from spindle_sim.tune import tune_tetris

RESULTS = Path(__file__).parent / "results"
BASELINES = {"Fixed SP=16": "fixed-sp:sp=16", "Fixed SP=8": "fixed-sp:sp=8", "LoongServe Disagg.": "request-sp"}
# 70B: 8 prefill instances of TP 4, so the fixed-SP baselines are the two largest groups that fit
BASELINES_70B = {"Fixed SP=8": "fixed-sp:sp=8", "Fixed SP=4": "fixed-sp:sp=4", "LoongServe Disagg.": "request-sp"}
FIXED_RATES = (0.1, 0.3, 0.5, 0.7)
WINDOW_S = 120.0  # each probed rate of a max-load search offers its load for at least this long
SLO_SCALE = 25.0  # the shared SLO: this times the lowest light-load P50 TTFT of the run's strategies
SHAPES_8B = {"": (16, 2), " 32+4": (32, 4)}  # run-key suffix -> (prefill instances, decode instances of TP 8)
RATES = {  # req/s, up to past each workload's saturation
    "tetris-short": [1, 2, 4, 6, 8, 10, 12, 14],
    "tetris-medium": [1, 2, 3, 4, 5, 6, 7, 8, 9],
    "tetris-long": [0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5],
}
PAPER = {
    "p50_ttft_reduction": [1.64, 2.78],
    "p99_ttft_reduction": [1.52, 3.13],
    "max_load_increase_pct": [20, 45],
    "single_chunk_p50_slowdown": [2.33, 4.17],
    "single_chunk_p99_slowdown": [2.64, 3.58],
    "p50_ttft_reduction_70b": [2.86, 4.17],
    "p99_ttft_reduction_70b": [2.27, 4.35],
    "single_chunk_p50_slowdown_70b": [2.71, 4.77],
}


def strategies(workload: str, baselines: dict[str, str], table: str = "") -> dict[str, str]:
    tetris = f"tetris:table={table or workload}"
    named = {**baselines, "Tetris": tetris, "Tetris single-chunk": f"{tetris},chunking=0"}
    return named | {f"Tetris rate={x:g}": f"tetris:improvement_rate={x:g}" for x in FIXED_RATES}


def cluster_8b(num_prefill: int = 16, num_decode: int = 2) -> tuple[LatencyModel, SimConfig]:
    config = SimConfig(
        num_prefill=num_prefill, num_decode=num_decode, decode_tp=8, gpus_per_node=8,
        scheduler=SchedulerConfig(max_num_requests=10**5),
    )  # fmt: skip
    return load_paper_calibration(), config


def baselines_70b(num_prefill: int) -> dict[str, str]:
    """The fixed-SP baselines of a 70B cluster: its two largest groups (SP 8 and 4 on the paper's 8 instances)."""
    if num_prefill == 8:
        return BASELINES_70B
    half = num_prefill // 2
    return {f"Fixed SP={num_prefill}": f"fixed-sp:sp={num_prefill}", f"Fixed SP={half}": f"fixed-sp:sp={half}",
            "LoongServe Disagg.": "request-sp"}  # fmt: skip


def cluster_70b(num_prefill: int = 8) -> tuple[LatencyModel, SimConfig]:
    nodes = (num_prefill * 4 + 4 * 8) // 8  # TP4 prefill instances and 4 decode instances of TP 8
    spec = ClusterSpec(
        "a100-80g",
        "llama3-70b",
        nodes=nodes,
        prefill_tp=4,
        decode_tp=8,
        num_prefill=num_prefill,
        num_decode=4,
        num_colocated=0,
    )
    setup = named_cluster(spec, colocated=False, scheduler=SchedulerConfig(max_num_requests=10**5))
    return setup.latency, setup.config


def _p(row: SweepRow, q: str) -> float:
    value = getattr(row.summary.ttft_s, q)
    return value if row.summary.completed == row.summary.num_requests else math.inf


def headline(rows: dict[str, list[SweepRow]], max_loads: dict[str, Any], baselines: dict[str, str]) -> dict[str, Any]:
    """Per workload: the best baseline over Tetris (P50, P99; max over the rates Tetris sustains), the max-load
    increase, single-chunk over CDSP, and Fig. 11's fixed rates over the dynamic choice at each rate."""
    tetris = rows["Tetris"]
    best_baseline = max((max_loads[b]["rate"] or 0.0) for b in baselines)
    # compared where both hold their SLO: past the baseline's max load any ratio is a saturated queue's
    limit = min(max_loads["Tetris"]["rate"] or math.inf, best_baseline or math.inf)
    out: dict[str, Any] = {}
    for q in ("p50", "p99"):
        ratios = [
            min(_p(rows[b][i], q) for b in baselines) / _p(t, q)
            for i, t in enumerate(tetris)
            if t.rate <= limit and _p(t, q) > 0
        ]
        out[f"{q}_ttft_reduction"] = max(ratios, default=None)
        single = [
            _p(s, q) / _p(t, q) for s, t in zip(rows["Tetris single-chunk"], tetris, strict=True) if t.rate <= limit
        ]
        out[f"single_chunk_{q}_slowdown"] = max(single, default=None)
    best = best_baseline
    out["compared_up_to_rps"] = None if limit == math.inf else limit
    out["max_load_rps"] = {k: v["rate"] for k, v in max_loads.items()}
    out["max_load_increase_pct"] = 100 * ((max_loads["Tetris"]["rate"] or 0.0) / best - 1) if best else None
    out["fig11_ttft_mean_vs_dynamic"] = {
        f"{x:g}": [
            r.summary.ttft_s.mean / t.summary.ttft_s.mean
            for r, t in zip(rows[f"Tetris rate={x:g}"], tetris, strict=True)
        ]
        for x in FIXED_RATES
    }
    return out


def run_workload(
    workload: str, baselines: dict[str, str], latency: LatencyModel, config: SimConfig, rates: list[float], n: int,
    bar: tqdm, with_max_load: bool = True, table: str = "",
) -> dict[str, Any]:  # fmt: skip
    named = strategies(workload, baselines, table)
    rows: dict[str, list[SweepRow]] = {}
    for name, spec in named.items():
        rows[name] = sweep([spec], rates, workload, latency, config, n, seed=0)
        bar.update(1)
    max_loads: dict[str, Any] = {}
    searched = [*baselines, "Tetris", "Tetris single-chunk"] if with_max_load else []
    light = {
        name: light_load(Probe(named[name], workload, latency, config, n), start_rate=rates[0]) for name in searched
    }
    best_light, light_rate, slo_s = None, None, None
    if light:  # one SLO for every strategy: from the best light load, never a strategy's own
        best_light = min(light, key=lambda k: light[k][1])
        light_rate, slo_s = light[best_light][0], SLO_SCALE * light[best_light][1]
    for name in searched:
        ml = max_sustainable_load(named[name], workload, latency, config, n, start_rate=rates[0], rel_tol=0.05,
                                  light_rate=light_rate, slo_s=slo_s, min_window_s=WINDOW_S)  # fmt: skip
        max_loads[name] = {"rate": ml.rate, "light_rate": ml.light_rate, "light_p50_s": light[name][1],
                           "slo_s": ml.slo_s, "slo_from": best_light, "window_s": WINDOW_S}  # fmt: skip
        bar.update(1)
    if not with_max_load:
        max_loads = {name: {"rate": None} for name in [*baselines, "Tetris"]}
    curves = {
        name: [{"rate": r.rate, "completed": r.summary.completed, "ttft_p50": r.summary.ttft_s.p50,
                "ttft_p99": r.summary.ttft_s.p99, "ttft_mean": r.summary.ttft_s.mean,
                "tbt_p50": r.summary.tbt_s.p50, "plan_us": getattr(r.summary, "plan_us", None)} for r in rs]
        for name, rs in rows.items()
    }  # fmt: skip
    return {"rates": rates, "strategies": named, "curves": curves, "max_load": max_loads,
            "baselines": list(baselines), "headline": headline(rows, max_loads, baselines)}  # fmt: skip


def plot(results: dict[str, Any], path: Path, ablation: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 7), squeeze=False)
    style = {
        "Fixed SP=16": "s--",
        "Fixed SP=8": "^--",
        "Fixed SP=4": "v--",
        "LoongServe Disagg.": "D--",
        "Tetris": "o-",
    }
    for col, (key, run) in enumerate(runs.items()):
        for row, q in enumerate(("ttft_p50", "ttft_p99")):
            ax = axes[row][col]
            for name, fmt in style.items():
                if name not in run["curves"]:
                    continue
                pts = [(c["rate"], c[q]) for c in run["curves"][name] if c["completed"] and c[q] == c[q]]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, label=name, ms=4)
            ax.set_yscale("log")
            ax.set_title(f"{key}: {'P50' if row == 0 else 'P99'} TTFT", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("TTFT (s)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Tetris Fig. 8/9 in Spindle's simulator (16 + 2 A100 instances, 32 + 4; 70B: 8 x TP4 + 4 x TP8)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)

    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 7), squeeze=False)
    for col, (key, run) in enumerate(runs.items()):
        ax = axes[0][col]
        for name, fmt in (("Tetris", "o-"), ("Tetris single-chunk", "x--")):
            pts = [(c["rate"], c["ttft_p50"]) for c in run["curves"][name] if c["completed"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, label=name, ms=4)
        ax.set_yscale("log")
        ax.set_title(f"{key}: Fig. 13, P50 TTFT", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for x, ratios in run["headline"]["fig11_ttft_mean_vs_dynamic"].items():
            ax.plot(run["rates"], ratios, "o-", label=f"rate {x}", ms=3)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{key}: Fig. 11, mean TTFT / dynamic", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ablation, dpi=100)


def table(results: dict[str, Any]) -> str:
    lines = [f"{'run':<22}{'metric':<28}{'paper':>14}{'spindle':>10}{'ratio':>8}  (ratio: to the range's nearer end)"]
    for key, run in results["runs"].items():
        h = run["headline"]
        suffix = "_70b" if key.startswith("70b") else ""
        for metric in ("p50_ttft_reduction", "p99_ttft_reduction", "max_load_increase_pct", "single_chunk_p50_slowdown",
                       "single_chunk_p99_slowdown"):  # fmt: skip
            paper = PAPER.get(metric + suffix) or PAPER.get(metric)
            ours = h.get(metric)
            span = f"{paper[0]:g}-{paper[1]:g}" if paper else "-"
            ratio = "-"
            if ours is not None and paper and ours == ours:  # 1.00: inside the paper's range
                ratio = (
                    f"{ours / paper[0]:.2f}"
                    if ours < paper[0]
                    else f"{ours / paper[1]:.2f}"
                    if ours > paper[1]
                    else "1.00"
                )
            lines.append(f"{key:<22}{metric:<28}{span:>14}{'-' if ours is None else f'{ours:.2f}':>10}{ratio:>8}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--quick", action="store_true", help="200 requests, 3 rates a workload, no max-load search")
    p.add_argument("--no-70b", action="store_true", help="skip the Llama-3-70B run")
    p.add_argument("--only-70b", action="store_true", help="only the Llama-3-70B run")
    p.add_argument("--prefill-70b", type=int, default=8, metavar="N",
                   help="TP-4 prefill instances of the 70B run (default 8, the paper's 32 GPUs; 16 is the ablation "
                        "with twice the SP choices)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "paper_tetris.json")
    args = p.parse_args()
    n = 200 if args.quick else args.num_requests
    step = 3 if args.quick else 1
    if args.no_70b and args.only_70b:
        p.error("--no-70b and --only-70b exclude each other")
    if args.prefill_70b < 2 or args.prefill_70b % 2:
        p.error(f"--prefill-70b must be an even number >= 2, got {args.prefill_70b}")
    runs_todo: list[tuple[str, str, dict[str, str], Any, list[float]]] = [
        (f"8b {w}{suffix}", w, BASELINES, lambda shape=shape: cluster_8b(*shape), RATES[w][::step])
        for suffix, shape in SHAPES_8B.items()
        for w in RATES
    ] if not args.only_70b else []  # fmt: skip
    if not args.no_70b:
        scale = args.prefill_70b / 8
        rates_70b = [round(r * scale, 4) for r in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2)][::step]
        key = "70b tetris-medium" if args.prefill_70b == 8 else f"70b {args.prefill_70b}+4 medium"
        runs_todo.append((key, "tetris-medium", baselines_70b(args.prefill_70b),
                          lambda: cluster_70b(args.prefill_70b), rates_70b))  # fmt: skip
    per_run = len(strategies("x", BASELINES)) + (0 if args.quick else len(BASELINES) + 2)
    start = time.perf_counter()
    results: dict[str, Any] = {"paper": PAPER, "num_requests": n, "runs": {}}
    with tqdm(total=per_run * len(runs_todo), desc="paper_tetris", unit="run") as bar:
        for key, workload, baselines, cluster, rates in runs_todo:
            latency, config = cluster()
            rate_table = ""
            if key.startswith("70b"):  # the shipped tables are the 8B cluster's: tune this one as §5.1 says
                tuned = tune_tetris(workload, rates, latency, config, num_requests=n)
                path = args.out.with_name(args.out.stem + "_70b_rates.json")
                path.write_text(json.dumps(tuned, indent=1))
                rate_table = str(path)
            run = run_workload(workload, baselines, latency, config, rates, n, bar, not args.quick, rate_table)
            results["runs"][key] = run
    results["wall_s"] = time.perf_counter() - start
    print(table(results))
    args.out.write_text(json.dumps(results, indent=1, default=lambda x: None))
    plot(results, args.out.with_suffix(".png"), args.out.with_name(args.out.stem + "_ablation.png"))
    print(f"wrote {args.out} and its PNGs in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
