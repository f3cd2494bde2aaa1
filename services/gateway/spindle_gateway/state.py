"""The gateway's shared state: settings, tokenizer, bus, cluster view, metrics and the requests in flight."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from spindle_model import Tokenizer
from spindle_protocol.bus import Bus

from . import tracing
from .cluster import ClusterView
from .config import GatewayConfig
from .inputs import Limits
from .metrics import GatewayMetrics

if TYPE_CHECKING:
    from .request_flow import Generation

log = logging.getLogger("spindle.gateway")


class GatewayState:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, bus: Bus) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.bus = bus
        self.cluster = ClusterView(bus, max_age=config.status_max_age)
        self.metrics = GatewayMetrics(config.served_model_name)
        self.tracer = tracing.tracer()
        self.created = int(time.time())
        self.live: dict[str, Generation] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def max_model_len(self) -> int:
        """The gateway's limit, or the cluster's when the scheduler reported a smaller one."""
        status = self.cluster.cached
        if status is not None and 0 < status.max_model_len < self.config.max_model_len:
            return status.max_model_len
        return self.config.max_model_len

    def limits(self) -> Limits:
        return Limits(self.max_model_len, self.config.vocab_size, self.config.max_stop_strings)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup coroutine outside the calling task (which may be being cancelled); kept until done."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def drain(self, timeout: float = 5.0) -> None:
        """Shutdown: end every request in flight with a 503 (streams get an error event), abort it everywhere,
        and wait for the cleanups."""
        for gen in list(self.live.values()):
            gen.interrupt("the gateway is shutting down", 503)
        deadline = time.monotonic() + min(2.0, timeout)
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for gen in list(self.live.values()):  # nobody consumed its stream
            gen.close("gateway shutting down")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
