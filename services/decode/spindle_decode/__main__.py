"""`python -m spindle_decode`: a decode instance."""

from __future__ import annotations

import argparse

from spindle_protocol import service
from spindle_worker import InstanceConfig

from .instance import DecodeInstance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_decode",
        description="Spindle decode instance: reserves blocks for prefilled requests, receives their KV over the "
        "data plane (or pulls it from the kvstore when it was full), decodes them with continuous batching and "
        "streams token ids to the gateway.",
    )
    service.add_worker_args(p, "decode")
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks of this instance: this process (rank R, the leader) and followers at ranks "
        "R+1..R+T-1, each `python -m spindle_decode.tp_follower --leader-rank R` (default %(default)s)",
    )
    service.add_engine_args(p)
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service.setup_logging(args.log_level, "decode")
    try:
        config = InstanceConfig.from_args("decode", args)
    except ValueError as e:
        build_parser().error(str(e))
    service.run(DecodeInstance(config).run, args.parent_pid)


if __name__ == "__main__":
    main()
