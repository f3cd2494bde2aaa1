"""The gateway's shared state: settings, tokenizer, bus, cluster view, metrics and the requests in flight."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spindle_protocol.bus import Bus
from spindle_tokenizer import Tokenizer

from . import tracing
from .batch.runner import BatchRunner
from .batch.store import BatchStore
from .cluster import ClusterView
from .config import GatewayConfig
from .dashboard import Dashboard
from .inputs import Limits
from .metrics import GatewayMetrics

if TYPE_CHECKING:
    from .request_flow import Generation

log = logging.getLogger("spindle.gateway")


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(tokenizer: Tokenizer) -> dict[str, Any]:
    """The sampling defaults of the model's generation_config.json (vLLM's `--generation-config auto`): what a
    request that omits temperature, top_p, top_k, min_p or repetition_penalty gets, and max_new_tokens as the
    default max_tokens of chat requests."""
    config = getattr(tokenizer, "generation_defaults", None) or {}
    return {k: config[k] for k in SAMPLING_DEFAULTS if config.get(k) is not None}


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
        self._token_texts: dict[int, str] = {}
        self.generation_defaults = generation_defaults(tokenizer)
        self.batches = BatchStore(Path(config.batch_db)) if config.batch_db else None
        self.batch_runner: BatchRunner | None = None  # create_app makes it (it runs lines through the app)
        self._cut_off: set[str] = set()  # requests in flight while the connection to nats-server was down
        self.dashboard = Dashboard(bus) if config.dashboard else None  # started by the server (it subscribes)

    def bus_lost(self) -> None:
        """The connection to nats-server dropped: what the requests in flight miss meanwhile is lost for good."""
        log.warning("lost nats-server with %d requests in flight", len(self.live))
        self._cut_off |= set(self.live)

    def bus_back(self) -> None:
        """Reconnected: every request that was in flight across the gap ends with a clear error (its events, published
        while we were away, are gone: it would otherwise wait for them until its deadline) and is aborted everywhere."""
        cut_off, self._cut_off = self._cut_off | set(self.live), set()
        for request_id in cut_off:
            if (gen := self.live.get(request_id)) is not None:
                gen.interrupt("the cluster's message bus (nats-server) restarted while this request ran; retry it", 503)
        log.warning("nats-server is back; ended %d requests that were in flight across the gap", len(cut_off))

    @property
    def max_model_len(self) -> int:
        """The gateway's limit, or the cluster's when the scheduler reported a smaller one."""
        status = self.cluster.cached
        if status is not None and 0 < status.max_model_len < self.config.max_model_len:
            return status.max_model_len
        return self.config.max_model_len

    def limits(self) -> Limits:
        return Limits(
            self.max_model_len,
            self.config.vocab_size,
            self.config.max_stop_strings,
            self.config.default_max_tokens,
            self.generation_defaults,
        )

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name each position's token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

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
        if self.batch_runner is not None:  # batches stay active in the store: the next gateway resumes them
            await self.batch_runner.stop()
        for gen in list(self.live.values()):
            gen.interrupt("the gateway is shutting down", 503)
        deadline = time.monotonic() + min(2.0, timeout)
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for gen in list(self.live.values()):  # nobody consumed its stream
            gen.close("gateway shutting down")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        if self.batches is not None:
            self.batches.close()
        if self.dashboard is not None:
            await self.dashboard.stop()
