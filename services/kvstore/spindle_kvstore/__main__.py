"""`python -m spindle_kvstore`: the host-memory KV block store."""

from __future__ import annotations

import argparse

from spindle_protocol import service

from .service import KVStoreConfig, KVStoreService


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_kvstore",
        description="Spindle kvstore: holds KV tensors of token ranges of requests in host memory (put / get / "
        "free by request and range, a memory budget, LRU eviction of unpinned entries). Requests arrive over NATS; "
        "the tensors move over the torch.distributed data plane, where the kvstore is usually rank 0.",
    )
    service.add_worker_args(p, "kvstore")
    g = p.add_argument_group("store")
    g.add_argument("--memory-gb", type=float, default=4.0, help="host memory budget in GiB (default %(default)s)")
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for every rank to join the data plane (default %(default)s)",
    )
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.memory_gb <= 0:
        p.error("--memory-gb must be positive")
    service.setup_logging(args.log_level, "kvstore")
    config = KVStoreConfig(
        instance_id=args.instance_id,
        nats_url=args.nats_url,
        rank=args.rank,
        world_size=args.world_size,
        dist_init=args.dist_init,
        memory_bytes=int(args.memory_gb * 2**30),
        otlp_endpoint=args.otlp_endpoint,
        dist_timeout_s=args.dist_timeout,
        node=args.node,
    )
    service.run(KVStoreService(config).run, args.parent_pid)


if __name__ == "__main__":
    main()
