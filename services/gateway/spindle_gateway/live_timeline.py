"""The cluster's live timeline, folded from what the scheduler hears: the workers' events, the registry's
heartbeats, the scheduler's decisions and aborts. Pure and synchronous (dashboard.py feeds it from NATS), in
bounded memory whatever the uptime: ring buffers for the timeline, LRU maps for what it remembers per request.

What it can show, and from what:
- prefill chunks: each instance's per-chunk PrefillProgress (the chunk's measured time, ending when the event is
  heard); the scheduler's plan (Decision) names a chunk's SP group, so its members' spans are linked;
- decode: the requests each instance holds between DecodeStarted and its end (RequestFinished / RequestFailed /
  Preempted / Abort): a band whose height is the batch size over time. Instances publish no per-step event, so
  single steps are not drawn (heartbeats' num_running correct a band left over by a lost event);
- iterations of a per-iteration strategy (LoongServe, Medha, Seesaw): IterationDone's measured time on the group
  its Decision named, with the prompts it ran and the decodes per master;
- KV transfers, parking, preemptions, migrations and re-shards from their events' measured times;
- KV blocks used and queues (waiting requests, queued prompt tokens) per instance at every heartbeat (0.5 s).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from spindle_protocol.messages import (
    Decision,
    DecodeStarted,
    InstanceInfo,
    IterationDone,
    KVMigrated,
    Preempted,
    PrefillProgress,
    RequestFailed,
    RequestFinished,
    Resharded,
    SPChunkSpec,
    TransferDone,
    WorkerEvent,
)
from spindle_telemetry.timeline import DecisionRow, InstanceRow, Span, Timeline, TimelineBuilder

NOTES = (
    "Live, in seconds since the gateway started: spans end when the gateway hears of them and last their measured "
    "time. Decode shows each instance's batch size over time (there is no per-step event), iterations come from "
    "IterationDone, KV and queues from the 0.5 s heartbeats.",
)
MAX_ENDS = 64  # prompt positions remembered per request (chunks are reported in order, give or take a few)
STALE_BAND_S = 2.0  # a decode band a heartbeat with num_running 0 contradicts for this long is closed


class _Lru(OrderedDict):
    """A dict that forgets its least recently set key beyond `limit` entries."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)


class LiveTimeline:
    def __init__(
        self,
        window_s: float = 120.0,
        max_window_s: float = 600.0,
        max_spans: int = 20_000,
        max_samples: int = 2_400,
        max_decisions: int = 2_000,
        max_instances: int = 256,
        max_requests: int = 4_096,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < window_s <= max_window_s:
            raise ValueError(f"window_s must be in (0, {max_window_s}], got {window_s}")
        self.window_s, self.max_window_s = window_s, max_window_s
        self.builder = TimelineBuilder(max_spans, max_samples, max_decisions, max_instances, merge_gap_s=0.05)
        self.origin = clock()
        self.strategy = ""
        self._max_instances = max_instances
        self._plans: _Lru = _Lru(max_requests)  # request id -> its plan's chunks
        self._ends: _Lru = _Lru(max_requests)  # request id -> prompt positions its chunks reported done so far
        self._batches: _Lru = _Lru(1024)  # batch id -> the iteration's Decision, until IterationDone
        self._decoding: _Lru = _Lru(max_instances)  # instance -> {request id: None} it decodes now
        self._changed: dict[str, float] = {}  # instance -> when its decode batch last changed
        self._iterating: _Lru = _Lru(max_instances)  # instances that run iterations (their spans come from those)
        self._max_batch = max_requests

    # ---- inputs ----

    def on_decision(self, d: Decision, now: float) -> None:
        self.strategy = d.strategy
        if d.kind == "plan":
            self._plans[d.request_id] = d.chunks
        elif d.kind == "iteration":
            self._batches[d.batch_id] = d
            for iid in d.instances:
                self._iterating[iid] = None
        if d.listed:
            self.builder.decision(DecisionRow(t=now, request_id=d.request_id, strategy=d.strategy, text=d.text))

    def on_heartbeat(self, info: InstanceInfo, now: float) -> None:
        iid = info.instance_id
        row = InstanceRow(id=iid, role=info.role, rank=info.rank, node=info.node, group=info.kvp_group or info.parallel,
                          kv_blocks_total=info.kv_blocks_total)  # fmt: skip
        self.builder.instance(row)
        if info.role == "kvstore":  # host memory, in MiB
            self.builder.kv(iid, now, info.kv_bytes_used >> 20, info.kv_bytes_total >> 20)
        else:
            self.builder.kv(iid, now, info.kv_blocks_used, info.kv_blocks_total)
        self.builder.queue(iid, now, info.num_waiting, info.queued_tokens)
        held = self._decoding.get(iid)
        if held and info.num_running == 0 and now - self._changed.get(iid, now) > STALE_BAND_S:
            held.clear()
            self._level(iid, now)

    def on_instance_left(self, instance_id: str, now: float) -> None:
        if self._decoding.pop(instance_id, None):
            self.builder.decode_level(instance_id, now, [])

    def on_abort(self, request_id: str, now: float) -> None:
        self._leave(request_id, now)
        self._forget(request_id)

    def on_event(self, event: WorkerEvent, now: float) -> None:
        match event:
            case PrefillProgress(request_id=rid, instance_id=iid, tokens_done=end, chunk_seconds=s):
                if iid not in self._iterating:  # an iteration's IterationDone draws its prompts
                    self._chunk(rid, iid, end, now - s, now)
            case TransferDone(request_id=rid, src_instance=src, dst_instance=dst, seconds=s, parked=parked):
                kind = "park" if parked else "transfer"
                self._move(dst, rid, now - s, now, kind, f"KV from {src}")
            case Preempted(request_id=rid, instance_id=iid, seconds=s):
                self._leave(rid, now)
                self._move(iid, rid, now - s, now, "park", "preempted: KV to the kvstore")
            case KVMigrated(request_id=rid, instance_id=src, dst=dst, seconds=s):
                self._move(dst, rid, now - s, now, "transfer", f"KV migrated from {src}")
            case Resharded(instance_id=iid, config=config, seconds=s):
                self._move(iid, "", now - s, now, "reshard", f"to {config}")
            case DecodeStarted(request_id=rid, instance_id=iid) if iid not in self._iterating:
                held = self._decoding.get(iid)
                if held is None:
                    held = self._decoding[iid] = {}
                if len(held) < self._max_batch:
                    held[rid] = None
                self._level(iid, now)
            case RequestFinished(request_id=rid) | RequestFailed(request_id=rid):
                self._leave(rid, now)
                self._forget(rid)
            case IterationDone(instance_id=iid, batch_id=bid, seconds=s):
                self._iteration(self._batches.pop(bid, None), iid, bid, now - s, now)

    # ---- output ----

    def snapshot(self, now: float, since: float | None = None) -> Timeline:
        """The window from `since` (default: the last `window_s` seconds; at most `max_window_s`) to now."""
        start = now - self.window_s if since is None else since
        start = min(max(start, now - self.max_window_s, self.origin), now)  # nothing before the gateway started
        title = "Spindle cluster (live)"
        return self.builder.snapshot(start, now, self.origin, title, self.strategy, NOTES)

    # ---- helpers ----

    def _chunk(self, rid: str, iid: str, end: int, t0: float, t1: float) -> None:
        """Prompt tokens up to `end` done on `iid` over [t0, t1]: the chunk's start and SP group from the plan, or
        else from the positions reported so far (an engine that chunks a prompt itself reports each step)."""
        chunk = next((c for c in self._plans.get(rid, ()) if c.end == end and iid in c.members), None)
        ends = self._ends.get(rid) or [0]
        if end not in ends:
            ends = sorted([*ends, end])[-MAX_ENDS:]
        self._ends[rid] = ends
        start = chunk.start if chunk else max((e for e in ends if e < end), default=0)
        group = _group(chunk)
        span = Span(instance=iid, start=t0, end=t1, kind="prefill", requests=[rid], group=group, sp=max(1, len(group)),
                    token_start=start, token_end=end)  # fmt: skip
        self.builder.chunk(span)

    def _iteration(self, d: Decision | None, iid: str, batch_id: int, t0: float, t1: float) -> None:
        members = d.instances if d is not None else [iid]
        label = f"iteration {batch_id}"
        if d is not None and d.prefill_requests:
            group = list(members) if len(members) > 1 else []
            for m in members:
                span = Span(instance=m, start=t0, end=t1, kind="prefill", requests=list(d.prefill_requests),
                            group=group, sp=len(members), label=label)  # fmt: skip
                self.builder.chunk(span)
        for master, n in (d.decode_masters if d is not None else {}).items():
            self.builder.decode_step(master, t0, t1, [], label=label, batch=n)

    def _move(self, iid: str, rid: str, t0: float, t1: float, kind: str, label: str) -> None:
        span = Span(instance=iid, start=t0, end=t1, kind=kind, requests=[rid] if rid else [], label=label)  # type: ignore[arg-type]
        self.builder.span(span)

    def _level(self, iid: str, now: float) -> None:
        self._changed[iid] = now
        if len(self._changed) > self._max_instances:
            self._changed = {k: v for k, v in self._changed.items() if k in self._decoding}
        self.builder.decode_level(iid, now, self._decoding.get(iid, {}))

    def _leave(self, rid: str, now: float) -> None:
        for iid, held in list(self._decoding.items()):
            if rid in held:
                del held[rid]
                self._level(iid, now)

    def _forget(self, rid: str) -> None:
        self._plans.pop(rid, None)
        self._ends.pop(rid, None)


def _group(chunk: SPChunkSpec | None) -> list[str]:
    return list(chunk.members) if chunk is not None and len(chunk.members) > 1 else []
