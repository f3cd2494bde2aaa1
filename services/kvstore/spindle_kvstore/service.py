"""The kvstore service: a KVStore behind NATS request-reply subjects, tensors over the data plane.

put:   KVPut -> reserve the bytes, post the receive under a new tag, reply ReserveReply(tag); the entry
       becomes readable when the tensor has arrived.
get:   KVGet -> reply KVGetReply(found, header), then send the tokens to `dst_rank` under the caller's tag
       (the caller posted its receive before asking); `free_after` drops the entries read once sent.
free:  KVFree -> KVFreeReply(freed_bytes).
abort: Abort -> free the request and cancel its receives in flight.
stats: StatsQuery -> InstanceStats with bytes in the kv_blocks fields and bytes per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from spindle_protocol import check_header, subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    Abort,
    InstanceInfo,
    InstanceStats,
    KVFree,
    KVFreeReply,
    KVGet,
    KVGetReply,
    KVPut,
    ReserveReply,
    StatsQuery,
    TensorHeader,
)
from spindle_protocol.registry import run_heartbeat
from spindle_transfer import DTYPES, DataPlane, TransferError, header_of

from .store import Entry, KVStore, check_kv_shape

try:
    import spindle_telemetry as telemetry
except ImportError:  # tracing is optional
    telemetry = None

log = logging.getLogger("spindle.kvstore")

TRANSFER_TIMEOUT_S = 60.0
TRANSFER_THREADS = 64  # a receive holds a thread while it waits for its sender
ABORT_MEMORY_S = 120.0  # how long an abort is remembered, for puts that arrive after it


@dataclass(frozen=True)
class KVStoreConfig:
    instance_id: str
    nats_url: str
    rank: int
    world_size: int
    dist_init: str
    memory_bytes: int
    otlp_endpoint: str | None = None
    dist_timeout_s: float = 300.0
    node: str = ""  # the node it reports ("": the host name)

    def __post_init__(self) -> None:
        subjects.check_token(self.instance_id, "instance id")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory budget must be positive, got {self.memory_bytes} bytes")


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass


class KVStoreService:
    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.id = config.instance_id
        self.store = KVStore(config.memory_bytes)
        self.started_at = time.time()
        self.aborted: dict[str, float] = {}
        self.receiving: dict[Entry, tuple[threading.Event, asyncio.Task]] = {}
        self.tasks: set[asyncio.Task] = set()
        self.bus: Bus
        self.dp: DataPlane
        self._tracer = telemetry.tracer("spindle.kvstore") if telemetry is not None else None

    # ---- lifecycle ----

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        if telemetry is not None:
            telemetry.setup("spindle-kvstore", cfg.otlp_endpoint)
        log.info("%s: joining the data plane as rank %d of %d", self.id, cfg.rank, cfg.world_size)
        dp = await self._join_data_plane(stop)
        if dp is None:
            return
        self.dp = dp
        self.bus = await Bus.connect(cfg.nats_url, f"spindle-{self.id}", inject=telemetry.inject if telemetry else None)
        await self.bus.subscribe(subjects.kvstore_put(self.id), KVPut, self._on_put)
        await self.bus.subscribe(subjects.kvstore_get(self.id), KVGet, self._on_get)
        await self.bus.subscribe(subjects.kvstore_free(self.id), KVFree, self._on_free)
        await self.bus.subscribe(subjects.ABORT, Abort, self._on_abort)
        await self.bus.subscribe(subjects.instance_stats(self.id), StatsQuery, self._on_stats)
        heartbeat = asyncio.create_task(run_heartbeat(self.bus, self.info))
        log.info("%s ready (rank %d, %.2f GiB)", self.id, cfg.rank, cfg.memory_bytes / 2**30)
        try:
            await stop.wait()
        finally:
            heartbeat.cancel()
            for cancel, _ in self.receiving.values():
                cancel.set()
            for task in [heartbeat, *self.tasks]:
                task.cancel()
            for task in [heartbeat, *self.tasks]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.bus.close()
            await asyncio.to_thread(self.dp.close)
            if telemetry is not None:
                telemetry.shutdown()

    async def _join_data_plane(self, stop: asyncio.Event) -> DataPlane | None:
        """DataPlane.init on a daemon thread (it blocks until every rank joins); None if stopped first."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        joined: asyncio.Future[DataPlane] = loop.create_future()

        def join() -> None:
            try:
                dp = DataPlane.init(
                    cfg.rank, cfg.world_size, cfg.dist_init, timeout_s=cfg.dist_timeout_s, max_workers=TRANSFER_THREADS
                )
                loop.call_soon_threadsafe(joined.set_result, dp)
            except BaseException as e:
                loop.call_soon_threadsafe(joined.set_exception, e)

        threading.Thread(target=join, name="spindle-dist-init", daemon=True).start()
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([joined, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        return joined.result() if joined.done() else None

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            instance_id=self.id,
            role="kvstore",
            rank=self.config.rank,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            kv_bytes_total=self.store.budget_bytes,
            kv_bytes_used=self.store.bytes_used,
            num_running=len(self.receiving),
            node=self.config.node or socket.gethostname(),
            device="cpu",  # host memory only
        )

    # ---- handlers ----

    async def _on_put(self, msg: KVPut, raw: Msg) -> ReserveReply:
        span = self._span("kvstore.put", raw, msg.request_id)
        span.set_attribute("spindle.bytes", msg.kv.nbytes)
        try:
            subjects.check_token(msg.request_id, "request id")
            check_header(msg.kv)
            check_kv_shape(msg.kv.shape, msg.start, msg.end)
            self._check_peer(msg.src_rank)
        except ValueError as e:
            return self._refuse(span, "bad_header", e)
        self._forget_old_aborts()
        if msg.request_id in self.aborted:
            return self._refuse(span, "aborted")
        try:
            entry = self.store.reserve(
                msg.request_id, msg.start, msg.end, DTYPES[msg.kv.dtype], msg.kv.shape, msg.pinned
            )
        except ValueError as e:
            return self._refuse(span, "exists", e)
        if entry is None:
            return self._refuse(span, "no_space")
        tag = self.dp.new_tag()
        cancel = threading.Event()
        task = self._spawn(self._receive(entry, msg.kv, msg.src_rank, tag, cancel, span))
        self.receiving[entry] = (cancel, task)
        return ReserveReply(accepted=True, tag=tag)  # the Bus replies now; the receive runs as a task

    async def _receive(
        self, entry: Entry, header: TensorHeader, src: int, tag: int, cancel: threading.Event, span: Any
    ) -> None:
        try:
            await self.dp.recv_async(header, src, tag, out=entry.tensor, cancel=cancel, timeout_s=TRANSFER_TIMEOUT_S)
            if not self.store.commit(entry):
                log.info("tokens [%d, %d) of %s arrived after it was freed", entry.start, entry.end, entry.request_id)
        except TransferError as e:
            self.store.discard(entry)
            span.record_exception(e)
            if not cancel.is_set():
                log.warning("receive of %s [%d, %d) failed: %s", entry.request_id, entry.start, entry.end, e)
        except asyncio.CancelledError:
            self.store.discard(entry)
            raise
        finally:
            self.receiving.pop(entry, None)
            span.end()

    async def _on_get(self, msg: KVGet, raw: Msg) -> KVGetReply | None:
        if self.store.has_pending(msg.request_id, msg.start, msg.end):
            # The sender's put may complete a moment before we commit it: answer once the receive is done.
            self._spawn(self._get_after_receive(msg, raw))
            return None
        return self._serve_get(msg, raw)

    async def _get_after_receive(self, msg: KVGet, raw: Msg) -> None:
        pending = [t for e, (_, t) in self.receiving.items() if e.request_id == msg.request_id]
        if pending:
            await asyncio.wait(pending, timeout=TRANSFER_TIMEOUT_S)
        reply = self._serve_get(msg, raw)
        if raw.reply:
            await self.bus.publish(raw.reply, reply)

    def _serve_get(self, msg: KVGet, raw: Msg) -> KVGetReply:
        span = self._span("kvstore.get", raw, msg.request_id)
        try:
            self._check_peer(msg.dst_rank)
            found = self.store.lookup(msg.request_id, msg.start, msg.end)
        except ValueError as e:
            span.end()
            return KVGetReply(found=False, reason=f"bad_request: {e}")
        if found is None:
            span.set_attribute("spindle.found", False)
            span.end()
            return KVGetReply(found=False, reason="not_found")
        tensor, entries = found
        header = header_of(tensor)
        span.set_attribute("spindle.bytes", header.nbytes)
        self._spawn(self._send(msg, tensor, header, entries, span))
        return KVGetReply(found=True, kv=header)  # the Bus replies before the send task runs

    async def _send(self, msg: KVGet, tensor: Any, header: TensorHeader, entries: list[Entry], span: Any) -> None:
        try:
            await self.dp.send_async(tensor, msg.dst_rank, msg.tag, header, timeout_s=TRANSFER_TIMEOUT_S)
            if msg.free_after:
                for entry in entries:
                    self.store.discard(entry)
        except TransferError as e:
            span.record_exception(e)
            log.warning(
                "send of %s [%d, %d) to rank %d failed: %s", msg.request_id, msg.start, msg.end, msg.dst_rank, e
            )
        finally:
            span.end()

    async def _on_free(self, msg: KVFree, raw: Msg) -> KVFreeReply:
        return KVFreeReply(freed_bytes=self._free(msg.request_id))

    async def _on_abort(self, msg: Abort, raw: Msg) -> None:
        self.aborted[msg.request_id] = time.monotonic()
        freed = self._free(msg.request_id)
        if freed:
            log.info("abort of %s freed %d bytes", msg.request_id, freed)

    async def _on_stats(self, msg: StatsQuery, raw: Msg) -> InstanceStats:
        stats = self.store.stats()
        return InstanceStats(
            instance_id=self.id,
            role="kvstore",
            kv_blocks_total=stats.bytes_total,
            kv_blocks_used=stats.bytes_used,
            requests=stats.requests,
        )

    # ---- helpers ----

    def _free(self, request_id: str) -> int:
        for entry, (cancel, _) in self.receiving.items():
            if entry.request_id == request_id:
                cancel.set()
        return self.store.free(request_id)

    def _check_peer(self, rank: int) -> None:
        if not 0 <= rank < self.config.world_size or rank == self.config.rank:
            raise ValueError(f"rank {rank} is not another rank of the data plane")

    def _forget_old_aborts(self) -> None:
        cutoff = time.monotonic() - ABORT_MEMORY_S
        for rid in [rid for rid, t in self.aborted.items() if t < cutoff]:
            del self.aborted[rid]

    def _refuse(self, span: Any, reason: str, error: Exception | None = None) -> ReserveReply:
        if error is not None:
            log.warning("refusing a put (%s): %s", reason, error)
        span.set_attribute("spindle.refused", reason)
        span.end()
        return ReserveReply(accepted=False, reason=reason)

    def _span(self, name: str, raw: Msg, request_id: str) -> Any:
        if self._tracer is None:
            return _NoSpan()
        span = self._tracer.start_span(name, context=telemetry.extract(dict(raw.headers or {})))
        span.set_attribute("spindle.request_id", request_id)
        return span

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
