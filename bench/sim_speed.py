"""How fast the simulator judges: each strategy's wall time on one cell, and whether it grows linearly.

    .venv/bin/python bench/sim_speed.py                      # 12,000 requests of mixed-chat at 100 req/s on 32 A100s
    .venv/bin/python bench/sim_speed.py --requests 1200 --strategies medha chunked

Every strategy gets the cluster shaped as `spindle sim compare` shapes it (the same `prepare`), then simulates the
cell's trace twice: its first quarter and all of it. A strategy whose cost is linear in the requests simulated
takes about 4x as long for the whole trace; `growth` is that ratio over 4 (1.0: linear; above: superlinear, e.g. a
planner that scans a queue growing past saturation). The target: every strategy under a minute at 12,000 requests
on this 2-core machine, growth near 1. The peer in the same run is the quarter trace of the same strategy; absolute
times depend on the machine (and on other work on it).

Prints a table and writes JSON (`--json`, default bench/results/sim_speed.json; a run of some strategies on the same
cell keeps the other strategies' rows):
{"cell": {...}, "strategies": {SPEC: {"requests": [n/4, n], "wall_s": [..], "events": [..], "us_per_request": [..],
"growth": x, "finished": n}}}.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from spindle_policy.core import SchedulerConfig
from spindle_policy.strategy import available_strategies
from spindle_sim.compare import build_compare_parser
from spindle_sim.executor import simulate
from spindle_sim.shapes import prepare
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--strategies", nargs="+", help="strategy specs (default: every registered strategy)")
    p.add_argument("--requests", type=int, default=12_000, help="requests in the whole trace (default 12,000)")
    p.add_argument("--rate", type=float, default=100.0, help="arrival rate, req/s (default 100: past most saturations)")
    p.add_argument("--workload", default="mixed-chat")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--hardware", default="a100-80g")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS / "sim_speed.json")
    args = p.parse_args()
    if args.requests < 4:
        p.error("--requests must be >= 4")
    specs = args.strategies or available_strategies()
    cell = ["--workload", args.workload, "--model", args.model, "--hardware", args.hardware, "--nodes", str(args.nodes),
            "--num-requests", str(args.requests), "--rate", str(args.rate), "--seed", str(args.seed)]  # fmt: skip
    entries = prepare(build_compare_parser().parse_args(cell), specs)
    trace = make_workload(args.workload, args.requests, args.rate, args.seed)
    sizes = [args.requests // 4, args.requests]
    out: dict[str, dict] = {}
    bar = tqdm(total=len(entries) * len(sizes), desc="sim_speed", unit="run")
    for e in entries:
        if e.skipped or e.setup is None:
            out[e.spec] = {"skipped": e.skipped}
            bar.update(len(sizes))
            continue
        row: dict[str, list] = {"requests": sizes, "wall_s": [], "events": [], "us_per_request": []}
        finished = 0
        for n in sizes:
            bar.set_postfix_str(f"{e.spec} x {n}")
            config = replace(e.setup.config, scheduler=SchedulerConfig(max_num_requests=n))
            started = time.perf_counter()
            result = simulate(trace[:n], e.spec, e.setup.latency, config)
            wall = time.perf_counter() - started
            row["wall_s"].append(round(wall, 3))
            row["events"].append(result.events)
            row["us_per_request"].append(round(1e6 * wall / n, 1))
            finished = sum(r.state == "finished" for r in result.records)
            bar.update()
        out[e.spec] = row | {"growth": round(row["wall_s"][1] / (4 * row["wall_s"][0]), 2), "finished": finished}
    bar.close()
    print(f"{args.workload} at {args.rate:g} req/s, {args.model} on {args.nodes} nodes of {args.hardware}")
    print(f"{'strategy':40s} {'wall s (n/4, n)':>18s} {'µs/request':>14s} {'growth':>7s} {'finished':>9s}")
    for spec, row in out.items():
        if "skipped" in row:
            print(f"{spec:40s} skipped: {row['skipped']}")
            continue
        walls = f"{row['wall_s'][0]:.1f}, {row['wall_s'][1]:.1f}"
        per = f"{row['us_per_request'][0]:.0f}, {row['us_per_request'][1]:.0f}"
        print(f"{spec:40s} {walls:>18s} {per:>14s} {row['growth']:>7.2f} {row['finished']:>9d}")
    cell = {"workload": args.workload, "rate": args.rate, "model": args.model, "hardware": args.hardware,
            "nodes": args.nodes, "seed": args.seed, "requests": args.requests}  # fmt: skip
    old = json.loads(args.json.read_text()) if args.json.exists() else {}
    kept = old.get("strategies", {}) if old.get("cell") == cell else {}  # a run of some strategies keeps the others
    doc = {"cell": cell, "strategies": kept | out}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
