"""`/dashboard`: the cluster live, drawn by spindle_telemetry's timeline page, and `/v1/spindle/timeline`, the JSON it
polls. The gateway hears what the scheduler hears (worker events, registry heartbeats) plus the scheduler's
decisions and aborts, and folds them into a LiveTimeline (live_timeline.py) while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import Abort, Decision, InstanceInfo, WorkerEvent
from spindle_protocol.registry import watch_registry
from spindle_telemetry.timeline import encode_json, render_html

from .errors import bad_request
from .live_timeline import LiveTimeline

log = logging.getLogger("spindle.gateway")

PAGE = "/dashboard"
TIMELINE = "/v1/spindle/timeline"


class Dashboard:
    def __init__(self, bus: Bus, timeline: LiveTimeline | None = None) -> None:
        self.bus = bus
        self.timeline = timeline or LiveTimeline()
        self._subs: list[Subscription] = []
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe (no queue group: every subscriber gets every message, the scheduler's copy is untouched)."""
        bus = self.bus
        self._subs = [
            await bus.subscribe(subjects.EVENTS, WorkerEvent, self._on_event),
            await bus.subscribe(subjects.DECISIONS, Decision, self._on_decision),
            await bus.subscribe(subjects.ABORT, Abort, self._on_abort),
        ]
        self._watch = asyncio.get_running_loop().create_task(watch_registry(bus, self._on_registry))
        log.info("dashboard on %s", PAGE)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs, self._watch = [], None

    async def _on_event(self, event: WorkerEvent, raw: Msg) -> None:
        self.timeline.on_event(event, time.time())

    async def _on_decision(self, decision: Decision, raw: Msg) -> None:
        self.timeline.on_decision(decision, time.time())

    async def _on_abort(self, abort: Abort, raw: Msg) -> None:
        self.timeline.on_abort(abort.request_id, time.time())

    def _on_registry(self, info: InstanceInfo | None, key: str) -> None:
        if info is None:
            self.timeline.on_instance_left(key, time.time())
        else:
            self.timeline.on_heartbeat(info, time.time())


def install(app: FastAPI, dashboard: Dashboard) -> None:
    @app.api_route(PAGE, methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def page() -> Response:
        """The cluster live: instances over time with the chunks (and SP groups) and decode batches they run, KV use,
        queues and the strategy's decisions; the page redraws the last 2 minutes every second."""
        timeline = dashboard.timeline.snapshot(time.time())
        return HTMLResponse(render_html(timeline, live_url=TIMELINE))

    @app.api_route(TIMELINE, methods=["GET", "HEAD"])
    async def window(since: float | None = None) -> Response:
        """The live timeline as JSON (spindle_telemetry.timeline.Timeline) from Unix time `since` (default: the last
        2 minutes; at most 10) to now."""
        if since is not None and not math.isfinite(since):
            raise bad_request(f"since must be a finite Unix time, got {since}", param="since")
        timeline = dashboard.timeline.snapshot(time.time(), since)
        return Response(encode_json(timeline), media_type="application/json")
