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
import sys

from spindle_engine.kvp.follower import follower
from spindle_protocol import service
from spindle_transfer import DataPlane
from spindle_worker.follower_args import check_follower_rank, follower_engine_config, follower_parser

log = logging.getLogger("spindle.decode.kvp")
# GOMP_SPINCOUNT is set by spindle_decode/__init__.py, which `python -m` imports before torch loads.


def build_parser() -> argparse.ArgumentParser:
    return follower_parser(
        "python -m spindle_decode.kvp_follower",
        "A follower member of a KV-parallel decode group: joins the data plane, loads the model, "
        "holds its token ranges of the group's KV and steps in lockstep with the leader (the decode instance at "
        "--leader-rank). Its KV capacity is --kv-cache-tokens / --kv-cache-memory-gb, like the leader's.",
        "--kvp-size",
        "members of the group (leader included)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_follower_rank(parser, args, args.kvp_size, "kvp")
    service.setup_logging(args.log_level, "decode-kvp")
    engine_config = follower_engine_config(parser, args)
    member = args.rank - args.leader_rank
    try:
        dp = DataPlane.init(args.rank, args.world_size, args.dist_init, device=engine_config.device)
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
