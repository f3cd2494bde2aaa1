"""Command-line flags shared by the follower processes of an instance (TP ranks, KVP members, pipeline stages)."""

from __future__ import annotations

import argparse
import os

from spindle_protocol import service


def follower_parser(prog: str, description: str, size_flag: str, size_help: str) -> argparse.ArgumentParser:
    """A parser with the data-plane, engine and logging flags every follower takes, and its group size flag."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--rank", type=int, required=True, help="this process's rank in the data-plane group")
    p.add_argument("--leader-rank", type=int, required=True, help="the rank of the instance's leader")
    p.add_argument(size_flag, type=int, required=True, help=size_help)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks in the data-plane group")
    p.add_argument("--dist-init", default="tcp://127.0.0.1:29500", help="torch.distributed rendezvous (%(default)s)")
    service.add_engine_args(p)
    p.add_argument("--log-level", default=os.environ.get("SPINDLE_LOG_LEVEL", "INFO"), help="DEBUG, INFO, ...")
    p.add_argument("--parent-pid", type=int, default=0, help="ignored (the launcher's death signal ends it)")
    p.add_argument("--instance-id", default=None, help="the leader's instance id, for the logs")
    return p


def check_follower_rank(parser: argparse.ArgumentParser, args: argparse.Namespace, size: int, what: str) -> range:
    """The instance's ranks (leader first); exits with a usage error unless this rank is one of its followers."""
    ranks = range(args.leader_rank, args.leader_rank + size)
    if size < 2 or args.rank not in ranks[1:] or ranks[-1] >= args.world_size:
        parser.error(f"rank {args.rank} is not a follower of leader {args.leader_rank} with {what} size {size}")
    return ranks
