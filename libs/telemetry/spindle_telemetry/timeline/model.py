"""The timeline of a cluster: what each instance ran over time, its KV use, the queues and the scheduler's
decisions. One model for the gateway's live `/dashboard` and for `spindle sim --timeline`; JSON-encodable
(msgspec). Times are seconds: Unix time on the live view, virtual time in the simulator."""

from __future__ import annotations

from typing import Literal

import msgspec

# prefill: a chunk of a prompt (on each member of its SP group); decode: one instance's decode batch over a time
# (its size in `batch`); transfer / park: KV moving to a decode instance / to the kvstore; reshard: a switch of
# parallel configuration (Seesaw)
SpanKind = Literal["prefill", "decode", "transfer", "park", "reshard"]
SPAN_KINDS: tuple[str, ...] = ("prefill", "decode", "transfer", "park", "reshard")
MAX_BATCH_IDS = 16  # request ids a decode span lists (its `batch` counts them all): a page stays small


class InstanceRow(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    role: str
    rank: int = -1
    node: str = ""
    group: str = ""  # a KV-parallel decode group or re-sharding configuration, when the instance reports one
    kv_blocks_total: int = 0


class Span(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`kind` work on `instance` over [start, end]. A prefill span names its request, its prompt tokens
    [token_start, token_end), how many chunks ran back to back in it, and, when it runs on an SP group, the group's
    instances (every member has a span of its own); a decode span names its batch size and (the first
    MAX_BATCH_IDS of) the requests in it when it began."""

    instance: str
    start: float
    end: float
    kind: SpanKind
    requests: list[str] = []
    label: str = ""
    group: list[str] = []
    sp: int = 1
    token_start: int = 0
    token_end: int = 0
    chunks: int = 1
    batch: int = 0


class KVSample(msgspec.Struct, array_like=True):
    """KV blocks used of `total` on an instance from `t` on (samples are kept only when the value changes)."""

    instance: str
    t: float
    used: int
    total: int


class QueueSample(msgspec.Struct, array_like=True):
    """Requests waiting on an instance and the prompt tokens queued there (not yet computed), from `t` on."""

    instance: str
    t: float
    waiting: int
    queued_tokens: int


class DecisionRow(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One of the strategy's decisions: e.g. "SP 4 on prefill-0..3, chunks 0-8192@1, 8192-20000@4, decode decode-1"."""

    t: float
    request_id: str = ""
    strategy: str = ""
    text: str = ""


class Timeline(msgspec.Struct, kw_only=True):
    """A window [start, end] of a cluster's timeline; the axis shows seconds since `origin`."""

    title: str = ""
    strategy: str = ""
    origin: float = 0.0
    start: float = 0.0
    end: float = 0.0
    instances: list[InstanceRow] = []
    spans: list[Span] = []
    kv: list[KVSample] = []
    queues: list[QueueSample] = []
    decisions: list[DecisionRow] = []
    notes: list[str] = []  # shown under the title (e.g. what a live view cannot show)


def encode_json(timeline: Timeline) -> bytes:
    return msgspec.json.encode(timeline)


def decode_json(data: bytes | str) -> Timeline:
    return msgspec.json.decode(data, type=Timeline)
