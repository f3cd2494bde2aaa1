"""How long `spindle` takes to plan one request at 128 prefill instances, beside `tetris` and `request-sp:grow`.

    .venv/bin/python bench/spindle_plan_time.py     # bench/results/spindle_plan_time.json (~20 s)

128 prefill instances in 16 nodes of 8 (and 2 decode instances), Eq. 1 fitted from the cost model (Llama-3-8B on
A100-80G) for SP 1-128, as `bench/tetris_plan_time.py` sets it up. Before each plan the queues are re-drawn: a
share of the instances idle (0 %, 30 %, 70 %: `spindle` sizes groups by the idle ones), the rest busy for 0-10 s;
prompt lengths from `mixed-diurnal` (chat turns and 1-20 % documents of 16K-256K tokens). The time is the
strategy's whole `plan()` on a cluster state (sorting the queues, every candidate plan, the decode placement, the
actions), in this Python process.
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
from spindle_policy.testing import instance_info, request_spec
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"
INSTANCES = 128
IDLE_SHARES = (0.0, 0.3, 0.7)
STRATEGIES = ("spindle:ttft_slo=1,ttft_per_ktok=0.05", "spindle", "tetris:improvement_rate=0.3", "request-sp:grow=1024")


def stats(ns: list[int]) -> dict[str, float]:
    us = sorted(x / 1e3 for x in ns)
    return {"mean": statistics.fmean(us), "p99": us[int(0.99 * (len(us) - 1))], "max": us[-1]}


def plan_times(spec: str, latency: object, lengths: list[int], idle: float, seed: int) -> tuple[list[int], dict]:
    """`plan()` on a core with 128 prefill instances whose queues are re-drawn before each plan; the SP sizes
    chosen."""
    rng = np.random.default_rng(seed)
    core = SchedulerCore(create_strategy(spec.replace("max_sp=0", ""), latency), SchedulerConfig())
    ids = [f"p{i}" for i in range(INSTANCES)]
    for rank, iid in enumerate([*ids, "d0", "d1"]):
        role = "prefill" if iid.startswith("p") else "decode"
        info = instance_info(iid, role, rank + 1, total=10**7, max_model_len=10**7)
        core.on_heartbeat(msgspec.structs.replace(info, node=f"node{rank // 8}"))
    times, sizes = [], {}
    for i, n in enumerate(lengths):
        busy = rng.uniform(0, 10, INSTANCES) * (rng.uniform(size=INSTANCES) >= idle)
        for iid, q in zip(ids, busy, strict=True):
            core.state.work_done((iid,), "earlier")
            if q > 0:
                core.state.plan_work((iid,), "earlier", float(q))
        rid = f"r{i}"
        t0 = time.perf_counter_ns()
        actions = core.strategy.plan(request_spec(rid, prompt=n, out=1), core.state, 0.0)
        times.append(time.perf_counter_ns() - t0)
        sp = max((len(c.instances) for a in actions if hasattr(a, "chunks") for c in a.chunks), default=0)
        sizes[sp] = sizes.get(sp, 0) + 1
        core.state.work_done(tuple(ids), rid)
    return times, dict(sorted(sizes.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", type=int, default=1000)
    p.add_argument("--out", type=Path, default=RESULTS / "spindle_plan_time.json")
    args = p.parse_args()
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    latency = latency_from_cost_model(cm, (1, 2, 4, 8, 16, 32, 64, 128))
    lengths = [r.num_prefill_tokens for r in make_workload("mixed-diurnal", args.plans, 1.0, seed=0)]
    out: dict[str, object] = {"instances": INSTANCES, "plans": args.plans, "workload": "mixed-diurnal", "rows": []}
    print(f"{'strategy':<40}{'idle':>6}{'mean us':>10}{'p99':>8}{'max':>8}  SP sizes chosen (0: deferred as late)")
    for spec in STRATEGIES:
        for idle in IDLE_SHARES:
            ns, sizes = plan_times(spec, latency, lengths, idle, seed=1)
            s = stats(ns)
            out["rows"].append({"strategy": spec, "idle_share": idle, "plan_us": s, "sp_sizes": sizes})  # type: ignore[attr-defined]
            print(f"{spec:<40}{idle:>6.0%}{s['mean']:>10.1f}{s['p99']:>8.0f}{s['max']:>8.0f}  {sizes}")
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
