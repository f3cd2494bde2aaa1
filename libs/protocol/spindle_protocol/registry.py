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

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig

from .bus import Bus
from .codec import ProtocolError, decode, encode
from .messages import InstanceInfo
from .subjects import REGISTRY_BUCKET

HEARTBEAT_S = 0.5
DEAD_AFTER_S = 2.5
TTL_S = 10.0
STALL_S = 2.0  # a registry watcher silent this long is made again (see watch_registry)

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


async def watch_registry(
    bus: Bus, on_update: Callable[[InstanceInfo | None, str], None], stall_s: float = STALL_S
) -> None:
    """Call `on_update(info, key)` for every heartbeat, and `on_update(None, key)` when an entry is deleted.

    Instances beat every HEARTBEAT_S, so a watcher silent for `stall_s` is broken (nats-server restarted under it:
    its consumer went with it) or watches an empty cluster: either way it is made again, which replays every
    current entry. Errors while nats-server is away are retried the same way; this returns only when cancelled.
    """
    while True:
        watcher = None
        try:
            kv = await registry_bucket(bus)
            watcher = await kv.watchall()
            while True:
                entry = await watcher.updates(timeout=stall_s)
                if entry is None:  # end of the initial values
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    on_update(None, entry.key)
                    continue
                try:
                    on_update(decode(entry.value, InstanceInfo), entry.key)
                except ProtocolError as e:
                    log.warning("bad registry entry %s: %s", entry.key, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a silent watcher (nats TimeoutError), or nats-server away
            if not isinstance(e, NatsTimeoutError):
                log.warning("registry watch interrupted (%s); watching again", e)
                await asyncio.sleep(0.5)
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watcher.stop(), 1.0)


def is_alive(info: InstanceInfo, now: float | None = None, dead_after: float = DEAD_AFTER_S) -> bool:
    return (now if now is not None else time.time()) - info.updated_at <= dead_after
