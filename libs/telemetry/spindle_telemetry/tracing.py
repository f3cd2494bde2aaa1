"""The process's tracer provider: OTLP/gRPC and/or a JSON-lines file, or nothing (a cheap no-op)."""

from __future__ import annotations

import os
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

# Short delay so that spans reach a collector (or a test's receiver) within a fraction of a second.
SCHEDULE_DELAY_MS = 200
EXPORT_TIMEOUT_S = 3.0

_lock = threading.Lock()
_provider: TracerProvider | None = None


def setup(service_name: str, otlp_endpoint: str | None = None) -> None:
    """Configure tracing for this process. Exporters: `otlp_endpoint` (or env OTEL_EXPORTER_OTLP_ENDPOINT),
    e.g. "http://127.0.0.1:4317", and env SPINDLE_TRACE_FILE (JSON lines). With neither, spans are no-ops.
    Calling it again replaces the previous provider (after flushing it)."""
    global _provider
    if not service_name:
        raise ValueError("service_name must be non-empty")
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    trace_file = os.environ.get("SPINDLE_TRACE_FILE") or None
    shutdown()
    if endpoint is None and trace_file is None:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS))
    if trace_file is not None:
        from .file_exporter import JsonLinesSpanExporter

        exporter = JsonLinesSpanExporter(trace_file)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS))
    with _lock:
        _provider = provider


class _Tracer(trace.Tracer):
    """Resolves the provider at each span start, so module-level `tracer(__name__)` works before `setup`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._noop = trace.NoOpTracer()

    def _delegate(self) -> trace.Tracer:
        provider = _provider
        # A no-op tracer still hands on the parent's context, so trace ids survive an untraced hop.
        return self._noop if provider is None else provider.get_tracer(self._name)

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._delegate().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._delegate().start_as_current_span(*args, **kwargs)


def tracer(name: str) -> trace.Tracer:
    """A tracer of the provider configured by `setup` (looked up at each span start; no-op without one).
    Use this rather than `opentelemetry.trace.get_tracer`: the global provider is left alone."""
    return _Tracer(name)


def shutdown() -> None:
    """Flush and stop the provider; safe to call twice or without setup."""
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()
