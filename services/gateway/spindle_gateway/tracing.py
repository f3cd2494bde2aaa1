"""Tracing through `spindle_telemetry` when it is installed; plain no-op OpenTelemetry spans otherwise."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context

try:
    import spindle_telemetry as _telemetry
except ImportError:  # the gateway still serves without it, untraced
    _telemetry = None

TRACER_NAME = "spindle.gateway"


def available() -> bool:
    return _telemetry is not None


def setup(service_name: str, otlp_endpoint: str | None) -> None:
    if _telemetry is not None:
        _telemetry.setup(service_name, otlp_endpoint)


def shutdown() -> None:
    if _telemetry is not None:
        _telemetry.shutdown()


def tracer() -> trace.Tracer:
    return _telemetry.tracer(TRACER_NAME) if _telemetry is not None else trace.NoOpTracer()


def inject_hook() -> Callable[[dict[str, str]], None] | None:
    """What Bus.connect takes as `inject`: writes `traceparent` of the current span into NATS headers."""
    return _telemetry.inject if _telemetry is not None else None


def extract(headers: Mapping[str, str]) -> Context | None:
    """The trace context an HTTP client sent (`traceparent`), so its trace continues through Spindle."""
    if _telemetry is None:
        return None
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
    return _telemetry.extract(carrier) if carrier else None
