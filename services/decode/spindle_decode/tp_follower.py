"""`python -m spindle_decode.tp_follower`: a follower rank of a tensor-parallel decode instance.

It holds its shard of the model and of every request's KV and steps in lockstep with its leader (the decode
instance at `--leader-rank`), replaying the engine calls the leader sends before each step
(spindle_engine.tp). A prompt's KV heads for this rank come straight from the prefill holders on the data plane
(header-checked `DataPlane.recv`, posted when the leader's `ReceiveKV` arrives); a parked or preempted request's
come from the leader. It talks no NATS: the leader alone publishes. It exits non-zero when the leader dies,
stays silent too long or the two diverge, and 0 when the leader stops the group.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from spindle_attention.distributed.comm import RankGroup
from spindle_engine.tp import Receiver, TPFollower, follower_engine
from spindle_protocol import service
from spindle_protocol.tensor_header import header_for
from spindle_transfer import DataPlane, dtype_name
from spindle_worker.follower_args import check_follower_rank, follower_engine_config, follower_parser

log = logging.getLogger("spindle.decode.tp")
RECEIVE_TIMEOUT_S = 120.0  # for a holder to start sending (the leader's drop cancels it sooner)
# GOMP_SPINCOUNT is set by spindle_decode/__init__.py, which `python -m` imports before torch loads.


def build_parser() -> argparse.ArgumentParser:
    return follower_parser(
        "python -m spindle_decode.tp_follower",
        "A follower rank of a tensor-parallel decode instance: joins the data plane, loads its shard "
        "of the model and steps in lockstep with the leader (the decode instance at --leader-rank).",
        "--tp-size",
        "ranks of the instance (leader included)",
    )


def data_plane_receiver(dp: DataPlane, pool: ThreadPoolExecutor, device: str = "cpu") -> Receiver:
    """Receives for `TPFollower`: each a header-checked `dp.recv` on `pool`, landing on `device` (the engine's)."""

    def receive(src: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype, cancel: threading.Event) -> Future:
        header = header_for(dtype_name(dtype), shape)
        fn = partial(dp.recv, header, src, tag, cancel=cancel, timeout_s=RECEIVE_TIMEOUT_S, device=device)
        return pool.submit(fn)

    return receive


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    ranks = tuple(check_follower_rank(parser, args, args.tp_size, "tp"))
    service.setup_logging(args.log_level, "decode-tp")
    engine_config = follower_engine_config(parser, args)
    try:
        dp = DataPlane.init(args.rank, args.world_size, args.dist_init, device=engine_config.device)
        engine = follower_engine(engine_config, RankGroup(ranks))
        log.info(
            "%s rank %d: following rank %d (%d KV blocks)",
            args.instance_id,
            args.rank,
            ranks[0],
            engine.allocator.num_blocks,
        )
        pool = ThreadPoolExecutor(8, thread_name_prefix="kv-receive")
        TPFollower(engine, ranks[0], receiver=data_plane_receiver(dp, pool, engine_config.device)).serve()
        pool.shutdown(wait=False, cancel_futures=True)
    except Exception:
        log.exception("tensor-parallel follower rank %d failed", args.rank)
        sys.exit(1)
    dp.close()


if __name__ == "__main__":
    main()
