"""`python -m spindle_elastic`: an elastic (colocated) instance."""

from __future__ import annotations

import argparse
from dataclasses import replace

from spindle_engine.reshard import ReshardPlan
from spindle_protocol import service
from spindle_worker import InstanceConfig
from spindle_worker.device import add_device_args

from .instance import DEFAULT_KV_CACHE_GB, ElasticInstance
from .seesaw import DEFAULT_HOST_KV_GB, SeesawGroup, seesaw_config

DEFAULT_SHARED_CHUNK = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_elastic",
        description="Spindle elastic (colocated) instance: prefills the prompts the scheduler plans onto it and "
        "decodes them in the same engine, prompt chunks mixed into the running decode batch under one per-step "
        "token budget (--max-num-batched-tokens: the chunk size); streams every token to the gateway. No KV "
        "moves. What a machine with few cores wants (`spindle up --elastic N`, the `chunked` strategy).",
    )
    service.add_worker_args(p, "elastic")
    service.add_engine_args(p)
    add_device_args(p, DEFAULT_KV_CACHE_GB)  # it holds every request's KV, prompt and decode
    p.add_argument(
        "--shared-chunk",
        type=int,
        default=DEFAULT_SHARED_CHUNK,
        help="prompt tokens one request may take per step while other requests share the instance: a long "
        "prompt then interleaves with the decodes and newer prompts instead of stalling them; alone it takes the "
        "whole --max-num-batched-tokens (%(default)s; 0 = no cap)",
    )
    p.add_argument(
        "--partial-kv",
        action="store_true",
        help="hold parts of requests longer than this instance's KV cache (a per-iteration strategy such as "
        "loongserve spreads a request's KV over a group of elastic instances): --max-model-len is then the group's "
        "context, not this cache's",
    )
    p.add_argument(
        "--spp-size",
        type=int,
        default=1,
        help="sequence-pipeline stages of this instance: this process (rank R) holds the first layer range and "
        "leads; stages R+1..R+S-1 are `python -m spindle_elastic.spp_stage --leader-rank R` processes. Consecutive "
        "chunks of one prompt flow through the stages back to back (Medha's SPP; default %(default)s)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="with --spp-size > 1: tensor-parallel ranks inside each stage (Medha's 2D); the instance's S x T ranks "
        "start at --rank, stage s at R+s*T.. (default %(default)s)",
    )
    g = p.add_argument_group("re-sharding (Seesaw)")
    g.add_argument(
        "--reshard",
        default="",
        metavar="PREFILL:DECODE",
        help="run as a re-sharding group (the seesaw strategy): this process and `python -m "
        "spindle_elastic.reshard_member` processes at the next ranks hold the model as PREFILL (a pipeline, PPa or "
        "PPaxTPb) for prefill and DECODE (TPc) for decode, switching on the scheduler's command, weights reloaded "
        "from one copy in shared host memory, the KV between the two in the group's host KV tier; e.g. PP2:TP2",
    )
    g.add_argument(
        "--host-kv-gb",
        type=float,
        default=DEFAULT_HOST_KV_GB,
        help="with --reshard: the host KV tier's size in GiB of shared memory (default %(default)s)",
    )
    g.add_argument("--host-kv-tokens", type=int, default=None, help="with --reshard: the tier's size in tokens instead")
    g.add_argument("--tier-root", default="", help="with --reshard: where the tier lives (default /dev/shm)")
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service.setup_logging(args.log_level, "elastic")
    if args.shared_chunk < 0:
        raise SystemExit(f"--shared-chunk must be >= 0, got {args.shared_chunk}")
    if args.spp_size > 1 and args.tp_size > 1 and args.partial_kv:
        raise SystemExit("a pipeline with TP inside its stages holds whole requests: it takes no --partial-kv")
    if args.tp_size > 1 and args.spp_size == 1:
        raise SystemExit("--tp-size applies inside the stages of a pipeline (--spp-size > 1)")
    if args.reshard:
        _run_group(args)
        return
    try:
        config = InstanceConfig.from_args("elastic", args)
    except ValueError as e:
        build_parser().error(str(e))
    engine = replace(config.engine, shared_prefill_chunk=args.shared_chunk, allow_partial_kv=args.partial_kv)
    config = replace(config, engine=engine)
    service.run(ElasticInstance(config).run, args.parent_pid)


def _run_group(args: argparse.Namespace) -> None:
    if args.spp_size > 1 or args.tp_size > 1 or args.partial_kv:
        raise SystemExit("--reshard names the group's configurations: no --spp-size, --tp-size or --partial-kv")
    if (args.host_kv_tokens is not None and args.host_kv_tokens < 1) or args.host_kv_gb <= 0:
        raise SystemExit("--host-kv-tokens and --host-kv-gb must be positive")
    try:
        plan = ReshardPlan.parse(args.reshard)
        config = seesaw_config(InstanceConfig.from_args("elastic", args), plan)
    except ValueError as e:
        build_parser().error(str(e))
    group = SeesawGroup(config, plan, args.host_kv_tokens, args.host_kv_gb, args.tier_root)
    service.run(group.run, args.parent_pid)


if __name__ == "__main__":
    main()
