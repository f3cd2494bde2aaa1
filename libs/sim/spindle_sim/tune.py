"""`spindle tune tetris`: Tetris's offline improvement-rate search (§5.1): for each arrival rate, simulate the
workload at every candidate improvement rate (the strategy with that rate fixed) and keep the rate with the
lowest mean TTFT; write the table `tetris:table=FILE` reads.

The paper samples the length distribution under Poisson arrivals at request rates 0.5 req/s apart and keeps
improvement rates between 0.05 and 0.75; those are the defaults. The cluster flags are `spindle sim`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spindle_policy.latency import LatencyModel

from .cluster import SimConfig
from .sweep import sweep

DEFAULT_IMPROVEMENT_RATES = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75)
METRIC = "mean"  # of TTFT: what the paper's profiler minimises ("the one that minimizes TTFT")


def tune_tetris(
    workload: str,
    arrival_rates: Sequence[float],
    latency: LatencyModel,
    config: SimConfig,
    improvement_rates: Sequence[float] = DEFAULT_IMPROVEMENT_RATES,
    num_requests: int = 1000,
    seed: int = 0,
    base_spec: str = "tetris",
) -> dict[str, Any]:
    """The table: one row per arrival rate with the best improvement rate and every candidate's TTFT."""
    if not improvement_rates or any(not 0 <= x < 1 for x in improvement_rates):
        raise ValueError(f"improvement rates must be in [0, 1), got {list(improvement_rates)}")
    sep = "," if ":" in base_spec else ":"
    specs = {x: f"{base_spec}{sep}improvement_rate={x:g}" for x in improvement_rates}
    rows = sweep(list(specs.values()), arrival_rates, workload, latency, config, num_requests, seed)
    by_rate: dict[float, dict[float, float]] = {}
    for row in rows:
        x = next(k for k, v in specs.items() if v == row.strategy)
        by_rate.setdefault(row.rate, {})[x] = getattr(row.summary.ttft_s, METRIC)
    table = []
    for rate, ttfts in sorted(by_rate.items()):
        best = min(ttfts, key=lambda x: (ttfts[x], x))
        table.append(
            {"arrival_rate": rate, "improvement_rate": best, "ttft_mean_s": {f"{x:g}": t for x, t in ttfts.items()}}
        )
    return {"workload": workload, "source": latency.source, "num_requests": num_requests, "seed": seed, "rows": table}


def build_parser() -> argparse.ArgumentParser:
    from .cli import _add_run_args

    p = argparse.ArgumentParser(
        prog="spindle tune tetris",
        description="Tetris's offline improvement-rate search: for each arrival rate, simulate the workload "
        "with every candidate improvement rate and keep the one with the lowest mean TTFT. The JSON it writes "
        "is what `--strategy tetris:table=FILE` looks up at run time (the arrival rate over a sliding window "
        "picks the closest row).",
        epilog="Example: spindle tune tetris --workload tetris-medium --rates 0.5,1,1.5,2,2.5,3 --instances 32 "
        "--decode-instances 4 --json table.json",
    )
    p.add_argument("strategy", choices=["tetris"], help="the strategy to tune (only tetris has a table)")
    p.add_argument("--rates", required=True, help="arrival rates in req/s, comma-separated (the paper: 0.5 apart)")
    p.add_argument(
        "--improvement-rates",
        default=",".join(f"{x:g}" for x in DEFAULT_IMPROVEMENT_RATES),
        help="candidate improvement rates, comma-separated (default %(default)s)",
    )
    p.add_argument("--base", default="tetris", help="the strategy spec the rate is added to (other options)")
    _add_run_args(p, num_requests=1000)
    p.add_argument("--json", type=Path, required=True, help="the table to write")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .cli import parse_rates, setups

    args = build_parser().parse_args(argv)
    try:
        rates = parse_rates([args.rates])
        try:
            candidates = parse_rates([args.improvement_rates])
        except ValueError as e:
            raise ValueError(f"--improvement-rates: expected comma-separated numbers ({e})") from None
        setup = setups(args, [args.base])[args.base]
        start = time.perf_counter()
        table = tune_tetris(
            args.workload, rates, setup.latency, setup.config, candidates, args.num_requests, args.seed, args.base
        )
    except ValueError as e:
        print(f"spindle tune: {e}", file=sys.stderr)
        return 2
    table["cluster"] = setup.shape.as_dict()
    args.json.write_text(json.dumps(table, indent=1))
    for row in table["rows"]:
        ttft = row["ttft_mean_s"][f"{row['improvement_rate']:g}"]
        print(
            f"{row['arrival_rate']:>6g} req/s -> improvement rate {row['improvement_rate']:g} (mean TTFT {ttft:.3f} s)"
        )
    print(f"wrote {args.json} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
