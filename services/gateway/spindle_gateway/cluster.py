"""What the gateway knows of the cluster: the scheduler's ClusterStatus (cached briefly) and per-instance stats."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.codec import ProtocolError
from spindle_protocol.messages import ClusterStatus, InstanceInfo, InstanceStats, StatsQuery, StatusQuery

log = logging.getLogger("spindle.gateway")


class ClusterView:
    def __init__(self, bus: Bus, max_age: float = 0.5, timeout: float = 1.0) -> None:
        self._bus = bus
        self._max_age = max_age
        self._timeout = timeout
        self._status: ClusterStatus | None = None
        self._error = "not queried yet"
        self._at = -1e9  # monotonic time of the last answer (or failure)
        self._lock = asyncio.Lock()

    @property
    def cached(self) -> ClusterStatus | None:
        """The last ClusterStatus the scheduler sent, however old (None if it never answered)."""
        return self._status

    @property
    def error(self) -> str:
        """Why the last query failed ("" when it succeeded)."""
        return self._error

    async def status(self, max_age: float | None = None) -> ClusterStatus | None:
        """A ClusterStatus at most `max_age` seconds old, or None when the scheduler does not answer."""
        max_age = self._max_age if max_age is None else max_age
        if time.monotonic() - self._at <= max_age:
            return None if self._error else self._status
        async with self._lock:  # concurrent callers share one query
            if time.monotonic() - self._at <= max_age:
                return None if self._error else self._status
            try:
                status = await self._bus.request(subjects.STATUS, StatusQuery(), ClusterStatus, timeout=self._timeout)
            except (NatsError, TimeoutError, ProtocolError) as e:
                self._error = f"scheduler did not answer: {type(e).__name__} {e}".strip()
                self._at = time.monotonic()
                return None
            self._status, self._error, self._at = status, "", time.monotonic()
            return status

    async def health(self) -> tuple[bool, str]:
        """Serving when the scheduler answers and sees at least one live prefill and one live decode instance (an
        elastic instance is both): (True, "ok"), or (True, "degraded: ...") while instances it has seen are dead
        (restarting, or left down); else (False, what is missing)."""
        status = await self.status()
        if status is None:
            return False, self._error
        roles = {inst.role for inst in status.instances}
        if "elastic" in roles:
            roles |= {"prefill", "decode"}
        missing = [r for r in ("prefill", "decode") if r not in roles]
        if missing:
            return False, f"no live {' or '.join(missing)} instance"
        if status.dead_instances:
            return True, f"degraded: {', '.join(status.dead_instances)} down"
        return True, "ok"

    async def instance_stats(self) -> list[dict[str, Any]]:
        """Exact state of every live instance, asked of each instance directly (1 s timeout each)."""
        status = await self.status(max_age=0.0)
        if status is None:
            raise ConnectionError(self._error)

        async def one(info: InstanceInfo) -> dict[str, Any]:
            where = {"device": info.device}  # from its heartbeat: "cpu", "cuda:N" ("" from older instances)
            try:
                stats = await self._bus.request(
                    subjects.instance_stats(info.instance_id), StatsQuery(), InstanceStats, timeout=1.0
                )
            except (NatsError, TimeoutError, ProtocolError, ValueError) as e:
                return {"instance_id": info.instance_id, **where, "error": f"{type(e).__name__}: {e}".rstrip(": ")}
            return msgspec.to_builtins(stats) | where

        return list(await asyncio.gather(*(one(inst) for inst in status.instances)))
