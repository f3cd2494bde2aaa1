"""TimelineBuilder: collects a timeline as it happens, in memory that stays bounded when asked to (ring buffers:
the live view runs for as long as the gateway does), and cuts windows of it (`snapshot`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

import msgspec

from .model import MAX_BATCH_IDS, DecisionRow, InstanceRow, KVSample, QueueSample, Span, Timeline


def _t(t: float) -> float:
    return round(t, 6)  # microseconds are plenty, and half the JSON


class TimelineBuilder:
    """`max_*` of None keep everything (a simulated run); numbers bound each buffer (the live view): the oldest
    spans and decisions go first, each instance keeps its last `max_samples` KV and queue samples, and at most
    `max_instances` instances are kept (the least recently heard of goes).

    Consecutive work of one kind merges, so that a long run stays a small page: `chunk` extends the instance's
    last prefill span when the same request's next tokens ran right after it on the same group, and `decode_step`
    (a step or iteration that ran over [start, end]) the instance's last decode span while the batch size stays
    the same. `decode_level` is the other form of decode work: the batch changed at t (the live view sees requests
    join and leave, not steps). "Right after" means within `merge_gap_s`."""

    def __init__(
        self,
        max_spans: int | None = None,
        max_samples: int | None = None,
        max_decisions: int | None = None,
        max_instances: int | None = None,
        merge_gap_s: float = 1e-6,
    ) -> None:
        self.spans: deque[Span] = deque(maxlen=max_spans)
        self.decisions: deque[DecisionRow] = deque(maxlen=max_decisions)
        self.instances: OrderedDict[str, InstanceRow] = OrderedDict()
        self._max_samples = max_samples
        self._max_instances = max_instances
        self._gap = merge_gap_s
        self._kv: dict[str, deque[KVSample]] = {}
        self._queues: dict[str, deque[QueueSample]] = {}
        self._last_chunk: dict[str, Span] = {}  # instance -> its latest prefill span (merged into)
        self._last_decode: dict[str, Span] = {}  # instance -> its latest decode step span (merged into)
        self._open: dict[str, Span] = {}  # instance -> its decode batch now (decode_level), end still open

    def instance(self, row: InstanceRow) -> None:
        self.instances[row.id] = row
        self.instances.move_to_end(row.id)
        if self._max_instances is not None and len(self.instances) > self._max_instances:
            gone, _ = self.instances.popitem(last=False)
            for per in (self._kv, self._queues, self._last_chunk, self._last_decode, self._open):
                per.pop(gone, None)  # type: ignore[attr-defined]

    def span(self, span: Span) -> None:
        span.start, span.end = _t(span.start), _t(span.end)
        self.spans.append(span)

    def chunk(self, span: Span) -> None:
        """A prefill span, merged into the instance's last one when it continues it."""
        last = self._last_chunk.get(span.instance)
        if (
            last is not None
            and last.requests == span.requests
            and last.group == span.group
            and last.token_end == span.token_start
            and abs(span.start - last.end) <= self._gap
        ):
            last.end, last.token_end, last.chunks = _t(max(last.end, span.end)), span.token_end, last.chunks + 1
            return
        self._last_chunk[span.instance] = span
        self.span(span)

    def decode_step(
        self, instance: str, start: float, end: float, requests: list[str], label: str = "", batch: int | None = None
    ) -> None:
        """A decode step (or the decode part of an iteration) of `requests` on `instance` over [start, end]; `batch`
        when only the batch size is known (the requests' ids are not)."""
        size = len(requests) if batch is None else batch
        last = self._last_decode.get(instance)
        if last is not None and last.batch == size and abs(start - last.end) <= self._gap:
            last.end = _t(max(last.end, end))
            return
        span = Span(instance=instance, start=start, end=end, kind="decode", requests=requests[:MAX_BATCH_IDS],
                    batch=size, label=label)  # fmt: skip
        self._last_decode[instance] = span
        self.span(span)

    def decode_level(self, instance: str, t: float, requests: Iterable[str]) -> None:
        """From `t` on, `instance` decodes `requests` (none: it is idle)."""
        rids = list(requests)
        current = self._open.pop(instance, None)
        if current is not None and current.batch == len(rids):
            current.requests = rids[:MAX_BATCH_IDS]
            self._open[instance] = current
            return
        if current is not None and t > current.start:
            current.end = _t(t)
            self.spans.append(current)
        if rids:
            self._open[instance] = Span(instance=instance, start=_t(t), end=_t(t), kind="decode",
                                        requests=rids[:MAX_BATCH_IDS], batch=len(rids))  # fmt: skip

    def kv(self, instance: str, t: float, used: int, total: int) -> None:
        samples = self._kv.setdefault(instance, deque(maxlen=self._max_samples))
        if not samples or (samples[-1].used, samples[-1].total) != (used, total):
            samples.append(KVSample(instance, _t(t), used, total))

    def queue(self, instance: str, t: float, waiting: int, queued_tokens: int) -> None:
        samples = self._queues.setdefault(instance, deque(maxlen=self._max_samples))
        if not samples or (samples[-1].waiting, samples[-1].queued_tokens) != (waiting, queued_tokens):
            samples.append(QueueSample(instance, _t(t), waiting, queued_tokens))

    def decision(self, row: DecisionRow) -> None:
        row.t = _t(row.t)
        self.decisions.append(row)

    def snapshot(
        self,
        start: float,
        end: float,
        origin: float = 0.0,
        title: str = "",
        strategy: str = "",
        notes: Iterable[str] = (),
    ) -> Timeline:
        """The window [start, end]: the spans that overlap it (a batch still running ends at `end`), each
        instance's samples in it with the one in force at `start`, and the decisions in it."""
        spans = [s for s in self.spans if s.end >= start and s.start <= end]
        spans += [msgspec.structs.replace(s, end=_t(end)) for s in self._open.values() if s.start <= end]
        return Timeline(
            title=title,
            strategy=strategy,
            origin=origin,
            start=start,
            end=end,
            instances=list(self.instances.values()),
            spans=spans,
            kv=[s for samples in self._kv.values() for s in _window(samples, start, end)],
            queues=[s for samples in self._queues.values() for s in _window(samples, start, end)],
            decisions=[d for d in self.decisions if start <= d.t <= end],
            notes=list(notes),
        )


def _window(samples: deque, start: float, end: float) -> list:
    """The samples of a step function in [start, end], led by the one in force at `start` (moved to `start`)."""
    out = []
    before = None
    for s in samples:
        if s.t < start:
            before = s
        elif s.t <= end:
            out.append(s)
    if before is not None:
        out.insert(0, msgspec.structs.replace(before, t=start))
    return out
