"""Driving the services directly over NATS in e2e tests (bypassing the scheduler)."""

from __future__ import annotations

import asyncio
import time

from spindle_launcher.stack import Stack


async def run_plan(
    stack: Stack, ids: list[int], plan: list, max_tokens: int, layout: str = "zigzag", csa_drop: float = 0.0
) -> tuple[list[int], str | None, dict[str, float] | None]:
    """Run `ids` under `plan` [(start, end, members)] on the prefill services, bypassing the scheduler. Returns the
    tokens, the error (None) and the last event's usage stats."""
    from spindle_protocol import subjects
    from spindle_protocol.bus import Bus
    from spindle_protocol.messages import (
        ClusterStatus,
        RequestSpec,
        RunPrefill,
        Sampling,
        SPChunkSpec,
        StatusQuery,
        StreamEvent,
    )
    from spindle_protocol.prompts import put_prompt

    bus = await Bus.connect(stack.nats_url, "test-sp-plan")
    try:
        rid = f"sp-plan-{time.monotonic_ns()}"
        events: list[StreamEvent] = []
        done = asyncio.Event()

        async def on_event(ev: StreamEvent, raw) -> None:
            events.append(ev)
            if ev.finished or ev.error:
                done.set()

        await bus.subscribe(subjects.stream(rid), StreamEvent, on_event)
        status = await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus)
        ranks = {i.instance_id: i.rank for i in status.instances}
        now = time.time()
        spec = RequestSpec(
            request_id=rid,
            prompt=await put_prompt(bus, rid, ids),
            sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
            arrival_time=now,
            deadline=now + 300,
        )
        chunks = [SPChunkSpec(start=s, end=e, members=m, layout=layout) for s, e, m in plan]
        members = chunks[-1].members
        cmd = RunPrefill(
            request=spec,
            decode_instance="decode-0",
            decode_rank=ranks["decode-0"],
            chunks=chunks,
            ranks={m: ranks[m] for m in members},
            csa_drop=csa_drop,
        )
        for m in members:
            await bus.publish(subjects.prefill_run(m), cmd)
        await asyncio.wait_for(done.wait(), 240)
        events.sort(key=lambda e: e.seq)
        error = next((e.error for e in events if e.error), None)
        stats = next((e.stats for e in reversed(events) if e.stats), None)
        return [t for e in events for t in e.token_ids], error, stats
    finally:
        await bus.close()
