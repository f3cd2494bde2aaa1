"""Instance registry: each instance puts its `InstanceInfo` into a JetStream KV bucket every
`HEARTBEAT_S`; entries expire after `TTL_S`. The scheduler watches the bucket and calls an instance dead
when its last heartbeat is older than `DEAD_AFTER_S` (it does not wait for the server-side expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.js.api import KeyValueConfig

from .bus import Bus
from .codec import ProtocolError, decode, encode
from .messages import InstanceInfo
from .subjects import REGISTRY_BUCKET

HEARTBEAT_S = 0.5
DEAD_AFTER_S = 2.5
TTL_S = 10.0

log = logging.getLogger("spindle.registry")


async def registry_bucket(bus: Bus):
    return await bus.js.create_key_value(config=KeyValueConfig(bucket=REGISTRY_BUCKET, ttl=TTL_S, history=1))


async def run_heartbeat(bus: Bus, info: Callable[[], InstanceInfo | None], interval: float = HEARTBEAT_S) -> None:
    """Put `info()` under its instance id until cancelled or `info()` returns None; then delete the entry (clean
    leave)."""
    kv = await registry_bucket(bus)
    key = None
    try:
        while True:
            current = info()
            if current is None:
                return
            key = current.instance_id
            try:
                await kv.put(key, encode(current))
            except Exception as e:  # the server may be restarting; keep beating
                log.warning("heartbeat failed: %s", e)
            await asyncio.sleep(interval)
    finally:
        if key is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(kv.delete(key), 1.0)


async def watch_registry(bus: Bus, on_update: Callable[[InstanceInfo | None, str], None]) -> None:
    """Call `on_update(info, key)` for every heartbeat, and `on_update(None, key)` when an entry is deleted."""
    kv = await registry_bucket(bus)
    watcher = await kv.watchall()
    async for entry in watcher:
        if entry is None:  # end of the initial values
            continue
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            on_update(None, entry.key)
            continue
        try:
            on_update(decode(entry.value, InstanceInfo), entry.key)
        except ProtocolError as e:
            log.warning("bad registry entry %s: %s", entry.key, e)


def is_alive(info: InstanceInfo, now: float | None = None, dead_after: float = DEAD_AFTER_S) -> bool:
    return (now if now is not None else time.time()) - info.updated_at <= dead_after
