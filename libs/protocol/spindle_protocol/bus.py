"""A typed wrapper over one NATS connection: publish / request / subscribe with protocol messages.

Headers carry the W3C trace context: pass `inject` (fills a header dict from the current span) and read
`msg.headers` in handlers. Handlers of request-reply subjects return the reply message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .codec import ProtocolError, decode, encode

T = TypeVar("T")
log = logging.getLogger("spindle.bus")

Handler = Callable[[Any, Msg], Awaitable[msgspec.Struct | None]]


class Bus:
    def __init__(self, nc: Client, inject: Callable[[dict[str, str]], None] | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._inject = inject

    @classmethod
    async def connect(
        cls, url: str, name: str, inject: Callable[[dict[str, str]], None] | None = None, **options: Any
    ) -> Bus:
        defaults = {"connect_timeout": 5, "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5}
        nc = await nats.connect(url, name=name, **(defaults | options))
        return cls(nc, inject)

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        out = dict(headers or {})
        if self._inject is not None:
            self._inject(out)
        return out or None

    async def publish(self, subject: str, message: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, encode(message), headers=self._headers(headers))

    async def request(
        self,
        subject: str,
        message: msgspec.Struct,
        reply_type: type[T],
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> T:
        """Request-reply; raises nats.errors.NoRespondersError / TimeoutError when nobody answers."""
        msg = await self.nc.request(subject, encode(message), timeout=timeout, headers=self._headers(headers))
        return decode(msg.data, reply_type)

    async def subscribe(self, subject: str, message_type: Any, handler: Handler, queue: str = "") -> Subscription:
        """Decode each message as `message_type` and call `handler(message, raw)`; a returned Struct is the reply."""

        async def on_message(msg: Msg) -> None:
            try:
                message = decode(msg.data, message_type)
            except ProtocolError as e:
                log.warning("dropping message on %s: %s", msg.subject, e)
                return
            try:
                reply = await handler(message, msg)
            except Exception:
                log.exception("handler for %s failed", msg.subject)
                return
            if reply is not None and msg.reply:
                await self.nc.publish(msg.reply, encode(reply), headers=self._headers(None))

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def close(self) -> None:
        if self.nc.is_connected:
            try:
                await asyncio.wait_for(self.nc.drain(), 2.0)
            except Exception:  # drain can race with a dead server; closing is best-effort
                await self.nc.close()
