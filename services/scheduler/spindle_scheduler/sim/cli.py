"""`spindle sim`: one simulated run of a strategy on a workload, summary printed and written as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..calibration import CALIBRATIONS, load_paper_calibration
from ..core import SchedulerConfig
from ..latency import LatencyModel
from ..strategy import available_strategies
from ..workloads import make_workload
from .cluster import SimConfig
from .executor import simulate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle sim",
        description="Simulate a cluster running a Spindle strategy: the real scheduler core on a virtual clock, "
        "with latencies from a profile of this machine (`spindle profile`) or from published figures.",
    )
    p.add_argument("--strategy", default="single", choices=available_strategies())
    p.add_argument("--workload", default="tetris-short", help="workload name (spindle_scheduler.workloads)")
    p.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, requests/s (inf: all at once)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrivals")
    p.add_argument("--instances", type=int, default=32, help="prefill instances")
    p.add_argument("--decode-instances", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, help="profile JSON written by `spindle profile`")
    source.add_argument(
        "--calibration", choices=sorted(CALIBRATIONS), help="published figures (default: tetris-a100-llama3-8b)"
    )
    p.add_argument("--decode-step-s", type=float, default=0.02, help="decode step time when the model has none")
    p.add_argument("--json", type=Path, help="write the summary here")
    return p


def _latency(args: argparse.Namespace) -> LatencyModel:
    if args.profile is not None:
        from ..profiler import load_profile

        return load_profile(args.profile)
    return load_paper_calibration(key=args.calibration or "tetris-a100-llama3-8b")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        latency = _latency(args)
        trace = make_workload(args.workload, args.num_requests, args.rate, args.seed, args.arrival, args.cv)
        config = SimConfig(
            num_prefill=args.instances,
            num_decode=args.decode_instances,
            decode_step_s=args.decode_step_s,
            scheduler=SchedulerConfig(max_num_requests=max(args.num_requests, 1)),
        )
        result = simulate(trace, args.strategy, latency, config)
    except ValueError as e:
        print(f"spindle sim: {e}", file=sys.stderr)
        return 2
    summary = result.summary(args.workload, args.rate)
    text = summary.to_json()
    if args.json is not None:
        args.json.write_text(text + "\n")
    d = json.loads(text)
    print(f"{args.strategy} on {args.workload} at {args.rate:g} req/s: {d['completed']}/{d['num_requests']} completed")
    for key in ("ttft_s", "tbt_s", "e2e_s"):
        s = d[key]
        print(f"  {key:7s} mean {s['mean']:.3f}  p50 {s['p50']:.3f}  p90 {s['p90']:.3f}  p99 {s['p99']:.3f}")
    print(f"  throughput {d['throughput_tok_s']:.1f} tok/s ({result.events} events, {result.wall_s:.2f} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
