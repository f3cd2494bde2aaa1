"""Command-line flags shared by the follower processes of an instance (TP ranks, KVP members, pipeline stages)."""

from __future__ import annotations

import argparse
import os

from spindle_engine import EngineConfig
from spindle_protocol import service

from .device import add_device_args
from .instance import engine_config_from_args


def follower_parser(
    prog: str, description: str, size_flag: str, size_help: str, cpu_kv_cache_memory_gb: float | None = None
) -> argparse.ArgumentParser:
    """A parser with the data-plane, engine, device and logging flags every follower takes, and its group size flag
    (`cpu_kv_cache_memory_gb`: the role's KV size on the CPU, as its leader's)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--rank", type=int, required=True, help="this process's rank in the data-plane group")
    p.add_argument("--leader-rank", type=int, required=True, help="the rank of the instance's leader")
    p.add_argument(size_flag, type=int, required=True, help=size_help)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks in the data-plane group")
    p.add_argument("--dist-init", default="tcp://127.0.0.1:29500", help="torch.distributed rendezvous (%(default)s)")
    service.add_engine_args(p)
    add_device_args(p, cpu_kv_cache_memory_gb)
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


def follower_engine_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """The follower's engine configuration; exits with a usage error for bad engine or device flags (a device this
    process does not have among them)."""
    try:
        return engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
