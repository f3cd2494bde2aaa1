"""`python -m spindle_decode`: a decode instance."""

from __future__ import annotations

import argparse

from spindle_protocol import service
from spindle_worker import InstanceConfig
from spindle_worker.device import add_device_args

from .instance import DecodeInstance
from .kvp_lockstep import KVPOptions


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
    p.add_argument(
        "--kvp-size",
        type=int,
        default=1,
        help="KV-parallel members of this instance: this process (rank R, member 0, the leader) and followers at "
        "ranks R+1..R+K-1, each `python -m spindle_decode.kvp_follower --leader-rank R`, each registered as a "
        "decode instance (ID, ID-kvp1, ...); a request's KV is split by token ranges over members, each with "
        "--kv-cache-tokens of its own (default %(default)s; needs "
        "--tp-size 1)",
    )
    p.add_argument(
        "--kvp-tokens",
        type=int,
        default=0,
        help="with --kvp-size > 1: the per-member KV token limit of a new request the group places itself (the "
        "scheduler's placement, PlaceKVP, comes first; this applies when none came or it does not fit now): a "
        "longer prompt is split over ceil(len / N) members (0 = on one member when one has room; default "
        "%(default)s)",
    )
    p.add_argument(
        "--kvp-scale-down-tokens",
        type=int,
        default=0,
        help="with --kvp-size > 1: a request's range shorter than this on a member that is not its master moves "
        "once, between steps, into a neighbouring member's range when that member has room for it and its growth "
        "(scale-down; 0 = never; default %(default)s)",
    )
    service.add_engine_args(p)
    add_device_args(p)
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service.setup_logging(args.log_level, "decode")
    try:
        config = InstanceConfig.from_args("decode", args)
        kvp = KVPOptions(args.kvp_size, args.kvp_tokens, args.kvp_scale_down_tokens)
        if kvp.size > 1 and config.tp_size > 1:
            raise ValueError("--kvp-size > 1 needs --tp-size 1 (a KV-parallel member holds the whole model)")
        if config.rank + kvp.size > config.world_size:
            raise ValueError(f"--kvp-size {kvp.size} from rank {config.rank} exceeds --world-size {config.world_size}")
    except ValueError as e:
        build_parser().error(str(e))
    service.run(DecodeInstance(config, kvp=kvp).run, args.parent_pid)


if __name__ == "__main__":
    main()
