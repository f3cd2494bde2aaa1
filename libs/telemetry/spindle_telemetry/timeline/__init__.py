"""A cluster's timeline (what each instance ran, KV use, queues, the scheduler's decisions) and its one-page HTML
view: the gateway's live `/dashboard` and `spindle sim --timeline` draw the same model with the same page.

    builder = TimelineBuilder()
    builder.span(Span(instance="prefill-0", start=0.0, end=0.4, kind="prefill", requests=["req-0"]))
    builder.decode_step("decode-0", 0.5, 0.52, ["req-0"])
    page = render_html(builder.snapshot(0.0, 1.0, title="my run"))
"""

from .builder import TimelineBuilder
from .model import (
    SPAN_KINDS,
    DecisionRow,
    InstanceRow,
    KVSample,
    QueueSample,
    Span,
    Timeline,
    decode_json,
    encode_json,
)
from .render import embedded_timeline, render_html

__all__ = [
    "SPAN_KINDS",
    "DecisionRow",
    "InstanceRow",
    "KVSample",
    "QueueSample",
    "Span",
    "Timeline",
    "TimelineBuilder",
    "decode_json",
    "embedded_timeline",
    "encode_json",
    "render_html",
]
