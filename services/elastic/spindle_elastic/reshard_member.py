"""`python -m spindle_elastic.reshard_member`: a process of a re-sharding (Seesaw) group other than its leader.

Joins the data plane, maps the weights the leader published to shared host memory, and serves each configuration
the leader names (a pipeline stage, or a tensor-parallel follower; its KV to and from the group's host tier) until
the leader closes the group. It talks no NATS and registers nothing: the leader answers for the group. Exits
non-zero when the leader dies or goes silent.
"""

from __future__ import annotations

import argparse
import logging
import sys

from spindle_engine.reshard import HostWeights, ReshardPlan
from spindle_engine.reshard.group import group_engine_config, serve_member
from spindle_engine.reshard.tier import tier_dir, weights_path
from spindle_model import resolve_model
from spindle_protocol import service
from spindle_transfer import DataPlane
from spindle_worker.follower_args import check_follower_rank, follower_engine_config, follower_parser

from .instance import DEFAULT_KV_CACHE_GB

log = logging.getLogger("spindle.elastic.reshard")


def build_parser() -> argparse.ArgumentParser:
    p = follower_parser(
        "python -m spindle_elastic.reshard_member",
        "A member of a re-sharding (Seesaw) elastic group other than its leader: rebuilt from the leader's weights "
        "in shared host memory as each parallel configuration the leader switches to. Takes the leader's engine "
        "flags and --reshard.",
        "--reshard-size",
        "processes of the group (the leader's included): the plan's",
        DEFAULT_KV_CACHE_GB,
    )
    p.add_argument("--reshard", required=True, help="the group's plan PREFILL:DECODE, e.g. PP2:TP2 (the leader's)")
    p.add_argument("--tier-root", default="", help="where the group's tier directory is (the leader's; default "
                   "/dev/shm)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = ReshardPlan.parse(args.reshard)
    except ValueError as e:
        parser.error(str(e))
    if plan.world != args.reshard_size:
        parser.error(f"--reshard {args.reshard} has {plan.world} processes, --reshard-size says {args.reshard_size}")
    check_follower_rank(parser, args, plan.world, "reshard")
    if not args.instance_id:
        parser.error("--instance-id (the leader's) names the group's tier directory")
    service.setup_logging(args.log_level, "elastic-reshard")
    engine_config = follower_engine_config(parser, args)
    try:
        model = resolve_model(args.model).config
        config = group_engine_config(engine_config, model, plan)
        dp = DataPlane.init(args.rank, args.world_size, args.dist_init, device=config.device)
        directory = tier_dir(args.instance_id, args.tier_root)
        log.info("%s: rank %d of a %s group led by rank %d", args.instance_id, args.rank, plan.label(),
                 args.leader_rank)  # fmt: skip
        serve_member(config, model, args.leader_rank, args.rank, lambda: HostWeights(weights_path(
            args.instance_id, args.tier_root)), directory)  # fmt: skip
    except Exception:
        log.exception("re-sharding group rank %d failed", args.rank)
        sys.exit(1)
    dp.close()


if __name__ == "__main__":
    main()
