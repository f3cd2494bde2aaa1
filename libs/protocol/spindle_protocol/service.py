"""What every `python -m spindle_<service>` shares: common flags, logging, signals, parent watch.

`run(main)` runs `main(stop)` on an asyncio loop; SIGINT/SIGTERM (or the death of the parent given by
`--parent-pid` / SPINDLE_PARENT_PID) set `stop`, and the service then shuts down cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# `spindle up` gives its gateway a random token in this variable; the gateway sends it back in this header of
# /health, so that the launcher's readiness check never takes another server on the same port for its own.
STACK_TOKEN_ENV = "SPINDLE_STACK_TOKEN"
STACK_TOKEN_HEADER = "x-spindle-stack"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("control plane and telemetry")
    g.add_argument(
        "--nats-url",
        default=os.environ.get("SPINDLE_NATS_URL", DEFAULT_NATS_URL),
        help="NATS server URL (env SPINDLE_NATS_URL; default %(default)s)",
    )
    g.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/gRPC endpoint for traces, e.g. http://127.0.0.1:4317 (env OTEL_EXPORTER_OTLP_ENDPOINT; "
        "default: tracing off)",
    )
    g.add_argument(
        "--log-level", default=os.environ.get("SPINDLE_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING or ERROR"
    )
    g.add_argument(
        "--parent-pid",
        type=int,
        default=int(os.environ.get("SPINDLE_PARENT_PID", "0")),
        help="exit when this process dies (set by `spindle up`; 0 = do not watch)",
    )


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of the instances that hold a model and join the data plane (prefill, decode, kvstore)."""
    g = parser.add_argument_group("instance and data plane")
    g.add_argument("--instance-id", default=f"{role}-{os.getpid()}", help="unique id ([A-Za-z0-9_-]); default ROLE-PID")
    g.add_argument("--rank", type=int, required=True, help="rank of this process in the data-plane group")
    g.add_argument("--world-size", type=int, required=True, help="number of ranks in the data-plane group")
    g.add_argument(
        "--dist-init",
        default="tcp://127.0.0.1:29500",
        help="torch.distributed rendezvous address of rank 0 (default %(default)s)",
    )
    g.add_argument(
        "--node",
        default="",
        help="the node this instance reports (strategies keep SP groups inside a node); default: the host name",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="smollm2", help="known model name, HF Llama directory or .gguf (default smollm2)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache capacity in tokens")
    g.add_argument(
        "--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size when --kv-cache-tokens is unset"
    )
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one engine step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            logging.getLogger("spindle").warning("parent %d is gone; shutting down", pid)
            stop.set()
            return
        if os.getppid() == 1 and pid != 1:
            stop.set()
            return
        await asyncio.sleep(0.5)


def run(main: Callable[[asyncio.Event], Awaitable[None]], parent_pid: int = 0) -> None:
    """Run `main(stop)` until it returns; signals and parent death set `stop`."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watcher = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid > 0 else None
        try:
            await main(stop)
        finally:
            if watcher is not None:
                watcher.cancel()

    asyncio.run(runner())
