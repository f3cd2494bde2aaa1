"""`python -m spindle_elastic.spp_stage`: a later stage of a sequence-pipeline-parallel elastic instance.

Joins the data plane, loads its layer range of the model and runs the steps the instance's leader (stage 0, the
`spindle_elastic` process at --leader-rank) sends down the pipeline, until the leader stops it. It talks no NATS
and registers nothing: the leader answers for the instance. Exits non-zero when a neighbour dies or goes silent.
"""

from __future__ import annotations

import argparse
import logging
import sys

from spindle_engine.spp import PipelineLayout, PipelineStage, load_stage, serve_stage
from spindle_protocol import service
from spindle_transfer import DataPlane
from spindle_worker.follower_args import check_follower_rank, follower_engine_config, follower_parser

from .instance import DEFAULT_KV_CACHE_GB, spp_pipeline_config

log = logging.getLogger("spindle.elastic.spp")


def build_parser() -> argparse.ArgumentParser:
    p = follower_parser(
        "python -m spindle_elastic.spp_stage",
        "A member of a sequence-pipeline-parallel elastic instance other than its leader: holds its stage's layer "
        "range (its heads of it with --tp-size > 1) and that KV, runs what the leader or the previous stage sends. "
        "Takes the leader's engine flags (every member sizes its cache alike).",
        "--spp-size",
        "pipeline stages of the instance (the leader's included)",
        DEFAULT_KV_CACHE_GB,
    )
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks per stage (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {args.tp_size}")
    check_follower_rank(parser, args, args.spp_size * args.tp_size, "spp x tp")
    layout = PipelineLayout.consecutive(args.leader_rank, args.spp_size, args.tp_size)
    stage_index, _ = layout.position(args.rank)
    service.setup_logging(args.log_level, "elastic-spp")
    engine_config = follower_engine_config(parser, args)
    try:
        config = spp_pipeline_config(engine_config, args.spp_size, args.tp_size)
        # first: a TP stage names global ranks
        dp = DataPlane.init(args.rank, args.world_size, args.dist_init, device=config.device)
        model, _ = load_stage(config, args.spp_size, stage_index, layout.stages[stage_index])
        num_blocks = config.kv_cache_tokens // config.block_size
        log.info(
            "%s stage %d (rank %d): layers %s at TP %d, %d KV blocks; following rank %d",
            args.instance_id, stage_index, args.rank, model.layer_range, args.tp_size, num_blocks, args.leader_rank,
        )  # fmt: skip
        serve_stage(PipelineStage(model, layout, args.rank, num_blocks=num_blocks, block_size=config.block_size))
    except Exception:
        log.exception("pipeline stage rank %d failed", args.rank)
        sys.exit(1)
    dp.close()


if __name__ == "__main__":
    main()
