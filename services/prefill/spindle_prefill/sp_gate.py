"""Joining a growing SP plan without holding the engine: wait, on the event loop, for the group's earlier chunks.

In a plan whose group grows (`request-sp:grow`), a member that joins at chunk k has nothing to do before the
members of chunk k - 1 finish it, and the joining chunk starts with their history re-balanced to it. Each
member of a chunk tells the next chunk's new members when it is done (`SPChunkDone`); a joiner enters the
chunk (and takes its engine thread) only once every member of the previous chunk has, so meanwhile its engine
serves other work. A member that gives the plan up tells every joiner, and they fail the request too instead
of waiting. After an abort the joiner still waits a while (the group runs a queued plan to its end, and
would wait for a missing member until its data plane's timeout), then gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spindle_protocol.messages import SPChunkDone, SPChunkSpec

POLL_S = 0.5


@dataclass
class _Entry:
    done: dict[int, set[str]] = field(default_factory=dict)  # chunk -> members that finished it
    error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def joins_at(chunks: list[SPChunkSpec], instance_id: str) -> int:
    """The first chunk `instance_id` computes (0: it is in the plan from the start)."""
    return next(i for i, c in enumerate(chunks) if instance_id in c.members)


def joiners_after(chunks: list[SPChunkSpec], k: int) -> list[str]:
    """Members of chunk k + 1 that are not in chunk k (none after the last chunk)."""
    if k + 1 >= len(chunks):
        return []
    return [m for m in chunks[k + 1].members if m not in chunks[k].members]


def all_joiners(chunks: list[SPChunkSpec]) -> list[str]:
    return [m for k in range(len(chunks) - 1) for m in joiners_after(chunks, k)]


class SPJoinGate:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def _entry(self, request_id: str) -> _Entry:
        return self._entries.setdefault(request_id, _Entry())

    def notify(self, msg: SPChunkDone) -> None:
        entry = self._entry(msg.request_id)
        if msg.error:
            entry.error = entry.error or f"{msg.member}: {msg.error}"
        else:
            entry.done.setdefault(msg.chunk, set()).add(msg.member)
        entry.changed.set()

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    async def wait(
        self,
        request_id: str,
        chunk: int,
        members: set[str],
        is_aborted: Callable[[], bool],
        abort_grace_s: float,
    ) -> str:
        """Until every one of `members` finished `chunk`: returns "" to go on, or why the plan cannot."""
        entry = self._entry(request_id)
        aborted_at: float | None = None
        while True:
            entry.changed.clear()
            if entry.error:
                return f"a group member gave the plan up ({entry.error})"
            if members <= entry.done.get(chunk, set()):
                return ""
            if is_aborted():
                aborted_at = aborted_at if aborted_at is not None else time.monotonic()
                if time.monotonic() - aborted_at > abort_grace_s:
                    missing = sorted(members - entry.done.get(chunk, set()))
                    return f"aborted while waiting for {missing} to finish chunk {chunk}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), POLL_S)
