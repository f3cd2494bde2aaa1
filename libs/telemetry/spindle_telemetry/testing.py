"""Test support: an in-process OTLP/gRPC trace receiver.

Usage:
    with OtlpReceiver() as rx:
        start_services(otlp_endpoint=rx.endpoint)
        spans = rx.wait_for(lambda spans: any(s.name == "decode" for s in spans))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    service: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str | None  # 16 hex digits, None for a root span
    start: int  # unix ns
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(self, request: Any, context: Any) -> Any:
        spans = []
        for rs in request.resource_spans:
            attrs = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            name=s.name,
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex() or None,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        )
                    )
        self._sink(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """A gRPC OTLP trace receiver on a free 127.0.0.1 port; collects spans in a thread-safe list."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self._add), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        assert self.port > 0
        self._started = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Spans grouped by trace id."""
        out: dict[str, list[ReceivedSpan]] = {}
        for s in self.spans:
            out.setdefault(s.trace_id, []).append(s)
        return out

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until `predicate(spans)` holds; returns the spans. Raises TimeoutError with what arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s.service}:{s.name}" for s in self._spans})
                    raise TimeoutError(f"spans received so far ({len(self._spans)}): {names}")
                self._cond.wait(left)
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def start(self) -> OtlpReceiver:
        if not self._started:
            self._server.start()
            self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._server.stop(grace=None)
            self._started = False

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
