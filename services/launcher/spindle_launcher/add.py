"""`spindle add`: more instances for a running `spindle up`, started by its launcher (asked over NATS).

    spindle add --prefill 1 --nats-url nats://127.0.0.1:4222

`spindle up` prints its NATS URL when it is up (fix it with `spindle up --nats-port`). The new instances take the
stack's spare data-plane ranks, join its mesh, register, and the scheduler plans with them from their first heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from spindle_protocol import AddedInstances, AddInstances, Bus, subjects

TIMEOUT_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spindle add",
        description="Start more instances in a running `spindle up` (its launcher starts them and restarts them "
        "if they die).",
    )
    p.add_argument("--prefill", type=int, default=0, help="prefill instances to add")
    p.add_argument("--decode", type=int, default=0, help="decode instances to add (one-process ones)")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="the stack's NATS (%(default)s)")
    return p


async def _ask(nats_url: str, role: str, count: int) -> AddedInstances:
    async def quiet(e: Exception) -> None:  # the one line main() prints says it
        pass

    connect = Bus.connect(
        nats_url, "spindle-add", allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, error_cb=quiet
    )
    bus = await asyncio.wait_for(connect, 5)
    try:
        return await bus.request(subjects.ADD_INSTANCES, AddInstances(role=role, count=count), AddedInstances,
                                 timeout=TIMEOUT_S)  # fmt: skip
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    wanted = [(role, n) for role, n in (("prefill", args.prefill), ("decode", args.decode)) if n]
    if not wanted or any(n < 0 for _, n in wanted):
        parser.error("name what to add: --prefill N and/or --decode N (N >= 1)")
    for role, n in wanted:
        try:
            reply = asyncio.run(_ask(args.nats_url, role, n))
        except Exception as e:  # no nats-server there, or no launcher listening (no responders)
            print(f"spindle add: no running `spindle up` answered at {args.nats_url} ({type(e).__name__})",
                  file=sys.stderr)  # fmt: skip
            return 1
        if reply.error:
            print(f"spindle add: {reply.error}", file=sys.stderr)
            return 1
        print(f"started {', '.join(reply.instance_ids)}; they serve once registered")
    return 0
