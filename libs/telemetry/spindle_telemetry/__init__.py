"""Spindle telemetry: one OpenTelemetry setup per service and W3C trace context over NATS headers.

Usage:
    setup("spindle-prefill", otlp_endpoint)        # once per process
    with tracer(__name__).start_as_current_span("prefill.chunk", context=extract(msg.headers)):
        await bus.publish(subject, message)        # Bus(nc, inject=inject) adds `traceparent`
    shutdown()                                     # flush on exit
"""

from .propagation import extract, inject
from .tracing import setup, shutdown, tracer

__all__ = ["extract", "inject", "setup", "shutdown", "tracer"]
