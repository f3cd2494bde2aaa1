"""Wall-clock cost of the simulator: `python -m spindle_sim.bench` (defaults: 10,000 requests on
48 prefill + 16 decode instances, `single`, Tetris Table 1 prefill calibration, constant decode step)."""

from __future__ import annotations

import argparse
import time

from spindle_policy.calibration import load_paper_calibration
from spindle_policy.core import SchedulerConfig

from .cluster import SimConfig
from .executor import simulate
from .workloads import make_workload


def time_simulation(
    num_requests: int = 10_000,
    num_prefill: int = 48,
    num_decode: int = 16,
    workload: str = "tetris-short",
    rate: float = 10.0,
    strategy: str = "single",
    seed: int = 0,
) -> dict[str, float]:
    """Run one simulation and return its wall time and headline metrics."""
    trace = make_workload(workload, num_requests, rate, seed)
    config = SimConfig(
        num_prefill=num_prefill,
        num_decode=num_decode,
        scheduler=SchedulerConfig(max_num_requests=max(num_requests, 1)),
    )
    started = time.perf_counter()
    result = simulate(trace, strategy, load_paper_calibration(), config)
    summary = result.summary(workload, rate)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "events": result.events,
        "virtual_s": result.end_time,
        "completed": summary.completed,
        "rejected": summary.rejected,
        "ttft_p50_s": summary.ttft_s.p50,
        "ttft_p99_s": summary.ttft_s.p99,
        "tbt_p50_s": summary.tbt_s.p50,
        "e2e_p50_s": summary.e2e_s.p50,
        "throughput_tok_s": summary.throughput_tok_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--prefill", type=int, default=48)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--workload", default="tetris-short")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    out = time_simulation(a.num_requests, a.prefill, a.decode, a.workload, a.rate, a.strategy, a.seed)
    for k, v in out.items():
        print(f"{k:>18}: {v:.4g}" if isinstance(v, float) else f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
