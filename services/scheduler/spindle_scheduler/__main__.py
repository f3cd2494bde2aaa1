"""`python -m spindle_scheduler`: the global scheduler service."""

from __future__ import annotations

import argparse
from pathlib import Path

import spindle_policy.strategies  # noqa: F401  (registers the built-in strategies)
from spindle_policy.core import SchedulerConfig
from spindle_policy.profile_data import load_profile
from spindle_policy.strategy import available_strategies
from spindle_protocol import service

from .service import SchedulerService, SchedulerServiceConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_scheduler",
        description="Spindle scheduler: admits requests, plans them onto prefill/decode instances with a "
        "named strategy, tracks instances by their heartbeats and fails the requests of dead ones.",
    )
    p.add_argument(
        "--strategy",
        default="single",
        help="placement strategy spec, NAME or NAME:key=value,... (default: single; available: "
        + ", ".join(available_strategies())
        + "; fixed-sp, request-sp and tetris plan with --profile, chunked needs elastic instances)",
    )
    p.add_argument("--profile", type=Path, help="latency profile JSON (`spindle profile`) for strategies that predict")
    p.add_argument(
        "--max-num-requests", type=int, default=256, help="requests in flight before new ones get 429 (default 256)"
    )
    p.add_argument(
        "--batch-share",
        type=float,
        default=0.5,
        help="most throughput-class (Batch API) requests in flight, as a share of --max-num-requests; the rest "
        "is kept for interactive requests (default %(default)s)",
    )
    p.add_argument("--model", default="", help="model name reported in the cluster status")
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service.setup_logging(args.log_level, "scheduler")
    try:
        latency = load_profile(args.profile) if args.profile else None
        config = SchedulerServiceConfig(
            nats_url=args.nats_url,
            strategy=args.strategy,
            core=SchedulerConfig(max_num_requests=args.max_num_requests, batch_share=args.batch_share),
            otlp_endpoint=args.otlp_endpoint,
            model=args.model,
            latency=latency,
        )
        scheduler = SchedulerService(config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"spindle_scheduler: {e}") from e
    service.run(scheduler.run, args.parent_pid)


if __name__ == "__main__":
    main()
