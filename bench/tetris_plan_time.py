"""How long `tetris` takes to plan one request (Tetris Table 2: 23-31 us average, <= 87 us max, in C++).

    python bench/tetris_plan_time.py     # bench/results/tetris_plan_time.json

128 prefill instances in 16 nodes of 8 with random queues (0-10 s) and a random prompt length from the
tetris-long workload, 1,000 plans per SP cap (8 ... 128), as the paper measures; Eq. 1 fitted from the cost
model (Llama-3-8B on A100-80G) for SP 1-128. Two timings: the planner alone (Algorithms 1-3) and the
strategy's whole `plan()` on a cluster state (sorting the queues, placing the decode, building the actions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import msgspec
import numpy as np

from spindle_costmodel import CostModel, get_hardware, get_model
from spindle_policy import SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.calibration import latency_from_cost_model
from spindle_policy.strategies.tetris.planner import CDSPConfig, CDSPPlanner
from spindle_policy.testing import instance_info, request_spec
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"
CAPS = (8, 16, 32, 64, 128)
PAPER_US = {8: (22.8, 52.5), 16: (25.8, 86.8), 32: (22.9, 53.4), 64: (24.9, 45.1), 128: (30.6, 73.7)}


def stats(ns: list[int]) -> dict[str, float]:
    us = sorted(x / 1e3 for x in ns)
    return {"mean": statistics.fmean(us), "p99": us[int(0.99 * (len(us) - 1))], "max": us[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", type=int, default=1000)
    p.add_argument("--improvement-rate", type=float, default=0.3)
    p.add_argument("--out", type=Path, default=RESULTS / "tetris_plan_time.json")
    args = p.parse_args()
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    latency = latency_from_cost_model(cm, (1, 2, 4, 8, 16, 32, 64, 128))
    coeffs = latency.prefill.coeffs  # type: ignore[union-attr]
    rng = np.random.default_rng(0)
    lengths = [r.num_prefill_tokens for r in make_workload("tetris-long", args.plans, 1.0, seed=0)]
    nodes = [f"node{i // 8}" for i in range(128)]
    out: dict[str, object] = {"paper_us": PAPER_US, "improvement_rate": args.improvement_rate, "caps": {}}
    head = f"{'max SP':>7}{'planner mean us':>17}{'p99':>8}{'max':>8}{'plan() mean us':>16}{'max':>8}{'chunks>1':>10}"
    print(head + "  paper mean/max")
    for cap in CAPS:
        sizes = tuple(s for s in sorted(coeffs) if s <= cap)
        config = CDSPConfig(sizes, args.improvement_rate)
        planner_ns, multi = [], 0
        for n in lengths:
            queues = sorted(rng.uniform(0, 10, 128).tolist())
            t0 = time.perf_counter_ns()
            plan = CDSPPlanner(config, coeffs, queues, nodes).plan(n)
            planner_ns.append(time.perf_counter_ns() - t0)
            multi += len(plan.chunks) > 1
        strategy_ns = strategy_times(latency, cap, lengths, rng, args.improvement_rate)
        row = {
            "planner_us": stats(planner_ns),
            "plan_us": stats(strategy_ns),
            "multi_chunk_share": multi / len(lengths),
        }
        out["caps"][cap] = row  # type: ignore[index]
        pl, st = row["planner_us"], row["plan_us"]
        paper = PAPER_US[cap]
        print(f"{cap:>7}{pl['mean']:>17.1f}{pl['p99']:>8.0f}{pl['max']:>8.0f}{st['mean']:>16.1f}{st['max']:>8.0f}"
              f"{row['multi_chunk_share']:>10.1%}  {paper[0]}/{paper[1]}")  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


def strategy_times(latency: object, cap: int, lengths: list[int], rng: np.random.Generator, rate: float) -> list[int]:
    """`TetrisStrategy.plan` on a core with 128 prefill instances whose queues are re-drawn before each plan."""
    core = SchedulerCore(create_strategy(f"tetris:improvement_rate={rate},max_sp={cap}", latency), SchedulerConfig())
    ids = [f"p{i}" for i in range(128)]
    for rank, iid in enumerate([*ids, "d0", "d1"]):
        role = "prefill" if iid.startswith("p") else "decode"
        node = f"node{rank // 8}"
        info = instance_info(iid, role, rank + 1, total=10**7, max_model_len=10**7)
        info = msgspec.structs.replace(info, node=node)
        core.on_heartbeat(info)
    times = []
    for i, n in enumerate(lengths):
        for iid, q in zip(ids, rng.uniform(0, 10, 128), strict=True):
            core.state.work_done((iid,), "earlier")
            core.state.plan_work((iid,), "earlier", float(q))
        spec = request_spec(f"r{i}", prompt=n, out=1)
        t0 = time.perf_counter_ns()
        core.strategy.plan(spec, core.state, 0.0)
        times.append(time.perf_counter_ns() - t0)
    return times


if __name__ == "__main__":
    main()
