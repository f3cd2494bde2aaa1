"""What `spindle`'s late-request rule buys and costs, at its max sustainable load in each mixed arena cell.

    .venv/bin/python bench/spindle_late.py     # bench/results/spindle_late.json (~1 min here)

For every mixed cell of `bench/arena.py` (its workload, arrivals and cluster), at the max load `spindle` reached
there (read from `bench/results/arena.json`), one 20-s trace (the arena's window) twice: with the rule and with
`defer_late=0`. It prints the SLO attainment of each, how many interactive requests the rule deferred as late, their
mean prompt, and their TTFT (every one of them completes; the table says how late).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arena import CLUSTERS, SCENARIOS, SLO_PER_KTOK, SLO_TPOT, SLO_TTFT, SPINDLE, WINDOW_S

from spindle_policy import SchedulerConfig
from spindle_policy.strategies.spindle.deferred import DeferredQueue
from spindle_policy.strategy import strategy_class
from spindle_sim.executor import Simulator
from spindle_sim.metrics import Slo
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.workloads import make_workload

RESULTS = Path(__file__).parent / "results"


class Recording(DeferredQueue):
    """The late queue, remembering every request it was given."""

    given: list[str]

    def add(self, spec, now: float) -> None:  # type: ignore[no-untyped-def]
        self.given = [*getattr(self, "given", []), spec.request_id]
        super().add(spec, now)


def run_cell(cell: str, rate: float) -> dict[str, object]:
    cluster, scenario = CLUSTERS[cell.split(":")[0]], SCENARIOS[cell.split(":")[1]]
    n = round(rate * WINDOW_S)
    cls = strategy_class("spindle")
    spec = ClusterSpec(cluster.hardware, cluster.model, nodes=cluster.nodes, prefill_share=cls.prefill_share)
    setup = named_cluster(spec, False, splits_context=True, scheduler=SchedulerConfig(max_num_requests=n))
    trace = make_workload(scenario.workload, n, rate, 0, scenario.arrival, scenario.cv)
    slo = Slo(ttft_s=SLO_TTFT, ttft_per_ktok_s=SLO_PER_KTOK, tpot_s=SLO_TPOT)
    off = Simulator(SPINDLE + ",defer_late=0", setup.latency, setup.config).run(trace).summary(slo=slo)
    sim = Simulator(SPINDLE, setup.latency, setup.config)
    strategy = sim.core.strategy
    strategy.late = Recording(strategy.late.reserve, strategy.late.max_wait_s, strategy.late.load)  # type: ignore[attr-defined]
    result = sim.run(trace)
    on = result.summary(slo=slo)
    records = {r.request_id: r for r in result.records}
    late = [records[rid] for rid in getattr(strategy.late, "given", [])]  # type: ignore[attr-defined]
    ttfts = sorted(r.ttft for r in late if r.ttft is not None)
    return {
        "cell": cell, "rate": rate, "requests": n, "attainment_with": on.slo_attainment,
        "attainment_without": off.slo_attainment, "late": len(late), "late_share": len(late) / n,
        "late_finished": sum(r.state == "finished" for r in late),
        "late_mean_prompt": statistics.fmean(r.num_prefill_tokens for r in late) if late else None,
        "late_ttft_p50": statistics.median(ttfts) if ttfts else None, "late_ttft_max": ttfts[-1] if ttfts else None,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arena", type=Path, default=RESULTS / "arena.json")
    p.add_argument("--out", type=Path, default=RESULTS / "spindle_late.json")
    args = p.parse_args()
    verdicts = json.loads(args.arena.read_text())["verdicts"]
    rows = []
    print(f"{'cell':<14}{'req/s':>7}{'att. with':>11}{'without':>9}{'late':>7}{'prompt':>9}{'TTFT p50':>10}{'max':>7}")
    for cell, v in verdicts.items():
        if cell.startswith("paper:") or not v.get("strategy"):
            continue
        row = run_cell(cell, v["max_load_rps"]["ours"])
        rows.append(row)
        print(f"{cell:<14}{row['rate']:>7g}{row['attainment_with']:>11.1%}{row['attainment_without']:>9.1%}"
              f"{row['late_share']:>7.1%}{row['late_mean_prompt'] or 0:>9.0f}{row['late_ttft_p50'] or 0:>10.1f}"
              f"{row['late_ttft_max'] or 0:>7.1f}")  # fmt: skip
    args.out.write_text(json.dumps({"window_s": WINDOW_S, "strategy": SPINDLE, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
