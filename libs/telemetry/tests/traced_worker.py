"""A stand-in service for the propagation test: answers one StatsQuery inside a child span, then exits.

Usage: python traced_worker.py NATS_URL OTLP_ENDPOINT SUBJECT   (prints "ready" once subscribed)
"""

import asyncio
import sys

import spindle_telemetry as telemetry
from spindle_protocol import Bus, InstanceStats, StatsQuery


async def main(nats_url: str, subject: str) -> None:
    bus = await Bus.connect(nats_url, "traced-worker", inject=telemetry.inject)
    done = asyncio.Event()
    tr = telemetry.tracer("traced_worker")

    async def handle(query: StatsQuery, msg) -> InstanceStats:
        with tr.start_as_current_span("worker.handle", context=telemetry.extract(msg.headers)):
            done.set()
            return InstanceStats(instance_id="w-0", role="prefill", kv_blocks_total=1, kv_blocks_used=0, requests={})

    await bus.subscribe(subject, StatsQuery, handle)
    await bus.nc.flush()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 30)
    await bus.close()


if __name__ == "__main__":
    telemetry.setup("test-worker", sys.argv[2])
    try:
        asyncio.run(main(sys.argv[1], sys.argv[3]))
    finally:
        telemetry.shutdown()
