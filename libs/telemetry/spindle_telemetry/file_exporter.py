"""A span exporter that appends one JSON object per span to a file (SPINDLE_TRACE_FILE).

Several processes may share one file: each batch is a single O_APPEND write. Times are unix nanoseconds.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,  # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER
        "status": span.status.status_code.name,  # UNSET, OK, ERROR
        "status_description": span.status.description or "",
        "service": span.resource.attributes.get("service.name"),
        "start": span.start_time,
        "end": span.end_time,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
