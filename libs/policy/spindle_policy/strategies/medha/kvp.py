"""Medha's KVP load balancer (§3.4, §4.3): which replicas hold a new request's KV, and where each of its prompt's
tokens goes. Pure functions of the replicas' free KV and pending work.

A request starts on one replica (the one with room and the least pending prefill work, then the most free KV).
When no replica can hold all of it (its prompt plus `max_tokens`), or it would hold more than `kvp_tokens` on one
(the paper's "worker KV-cache token limit"), it spans replicas: its prompt fills the first one's share, the next
chunks go to the next replica ("workers are added once we exceed the worker KV-cache token limit"), and so on; the
last replica takes the rest of the prompt and every decoded token, so it masters the decodes. Each replica's share
is reserved at admission, so no later admission can force an eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Room:
    """What the balancer knows of one replica."""

    id: str
    free: int  # KV tokens not reserved, in whole blocks
    block: int
    pending_s: float  # predicted prefill work queued on it

    def blocks_for(self, tokens: int) -> int:
        """`tokens` rounded up to whole blocks."""
        return -(-tokens // self.block) * self.block


@dataclass(frozen=True)
class Span:
    """Replica `id` holds prompt tokens [start, end) (and, on the last span, every decoded token): `reserve` KV
    tokens, in whole blocks."""

    id: str
    start: int
    end: int
    reserve: int


def place(rooms: Sequence[Room], prompt: int, max_tokens: int, kvp: int, kvp_tokens: int) -> list[Span] | None:
    """The spans of a new request over `rooms`, or None when they cannot hold it now. `kvp`: the most replicas it
    may span (0: any); `kvp_tokens`: the most KV tokens it may hold on one replica (0: the replica's room)."""
    need = prompt + max_tokens
    order = sorted(rooms, key=lambda r: (r.pending_s, -r.free))
    cap = kvp_tokens or need
    for r in order:  # one replica, when one can hold it all
        if need <= cap and r.blocks_for(need) <= r.free:
            return [Span(r.id, 0, prompt, r.blocks_for(need))]
    if kvp == 1:
        return None
    spans: list[Span] = []
    at = 0  # prompt tokens placed so far
    for r in order:
        room = min(r.free, cap)
        if prompt - at + max_tokens <= room:  # the rest of the prompt and every decoded token
            spans.append(Span(r.id, at, prompt, r.blocks_for(prompt - at + max_tokens)))
            return spans if not kvp or len(spans) <= kvp else None
        take = min(room, prompt - at - 1)  # leave the last replica at least one prompt token: it samples the first
        if take <= 0:
            continue
        spans.append(Span(r.id, at, at + take, r.blocks_for(take)))
        at += take
    return None


def fits_ever(rooms: Sequence[Room], prompt: int, max_tokens: int, kvp: int, kvp_tokens: int) -> bool:
    """Whether the replicas, empty (`free` = their capacity), could hold the request at all (else it is refused,
    not queued)."""
    return place(rooms, prompt, max_tokens, kvp, kvp_tokens) is not None
