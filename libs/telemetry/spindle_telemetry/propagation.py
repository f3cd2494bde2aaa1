"""W3C trace context (`traceparent`, `tracestate`) in NATS message headers."""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def inject(headers: dict[str, str]) -> None:
    """Write the current span's `traceparent` into `headers` (nothing when no span is active)."""
    _PROPAGATOR.inject(headers)


def extract(headers: dict[str, str] | None) -> Context:
    """The context carried by `headers`: use it as `context=` of a child span. Missing/bad headers -> empty."""
    return _PROPAGATOR.extract(headers or {})
