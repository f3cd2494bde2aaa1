"""`python -m spindle_decode.kvp_follower`: a follower member of a KV-parallel (KVP) decode group.

It holds the whole model and its member's token ranges of the group's requests' KV, masters the requests the
leader gives it (runs their layers, samples their tokens) and serves the other masters' queries over its ranges,
stepping in lockstep with the leader (the decode instance at `--leader-rank`, member 0), whose placement calls
it replays before each step (spindle_engine.kvp.lockstep). It talks no NATS: the leader alone publishes. It exits
non-zero when the leader dies or stays silent too long or the members diverge, and 0 when the leader stops;
another member's death only drops the requests that member had a part in (the leader says `Gone`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from spindle_engine.kvp.lockstep import follower
from spindle_protocol import service
from spindle_transfer import DataPlane
from spindle_worker.instance import engine_config_from_args

log = logging.getLogger("spindle.decode.kvp")
# GOMP_SPINCOUNT is set by spindle_decode/__init__.py, which `python -m` imports before torch loads.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_decode.kvp_follower",
        description="A follower member of a KV-parallel decode group: joins the data plane, loads the model, "
        "holds its token ranges of the group's KV and steps in lockstep with the leader (the decode instance at "
        "--leader-rank). Its KV capacity is --kv-cache-tokens / --kv-cache-memory-gb, like the leader's.",
    )
    p.add_argument("--rank", type=int, required=True, help="this process's rank in the data-plane group")
    p.add_argument("--leader-rank", type=int, required=True, help="the rank of the group's leader (member 0)")
    p.add_argument("--kvp-size", type=int, required=True, help="members of the group (leader included)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks in the data-plane group")
    p.add_argument("--dist-init", default="tcp://127.0.0.1:29500", help="torch.distributed rendezvous (%(default)s)")
    service.add_engine_args(p)
    p.add_argument("--log-level", default=os.environ.get("SPINDLE_LOG_LEVEL", "INFO"), help="DEBUG, INFO, ...")
    p.add_argument("--parent-pid", type=int, default=0, help="ignored (the launcher's death signal ends it)")
    p.add_argument("--instance-id", default=None, help="the leader's instance id, for the logs")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    ranks = range(args.leader_rank, args.leader_rank + args.kvp_size)
    if args.kvp_size < 2 or args.rank not in ranks[1:] or ranks[-1] >= args.world_size:
        parser.error(f"rank {args.rank} is not a follower of leader {args.leader_rank} with kvp size {args.kvp_size}")
    service.setup_logging(args.log_level, "decode-kvp")
    engine_config = engine_config_from_args(args)
    member = args.rank - args.leader_rank
    try:
        dp = DataPlane.init(args.rank, args.world_size, args.dist_init)
        group = follower(engine_config, args.kvp_size, args.leader_rank, member)
        log.info(
            "%s member %d (rank %d): following rank %d (%d KV blocks)",
            args.instance_id, member, args.rank, args.leader_rank, group.member.shard.allocator.num_blocks,
        )  # fmt: skip
        group.serve()
    except Exception:
        log.exception("KV-parallel member %d (rank %d) failed", member, args.rank)
        sys.exit(1)
    dp.close()


if __name__ == "__main__":
    main()
