"""The simulator's virtual clock: a heap of timed events, ties broken by insertion order."""

from __future__ import annotations

import enum
import heapq
from typing import Any


class EventKind(enum.IntEnum):
    HEARTBEAT = 0  # every instance publishes its InstanceInfo into the core
    TICK = 1  # core.tick (dead-instance detection)
    ARRIVAL = 2
    CHUNK_DONE = 3  # a prefill chunk finished on its SP group
    TRANSFER_DONE = 4
    DECODE_STEP = 5  # a decode (or colocated mixed) step finished
    SWAP_OUT_DONE = 6  # a preempted request's KV reached the kvstore; its decode blocks free
    SWAP_IN_DONE = 7  # a preempted request's KV is back on its decode instance; it rejoins the batch
    ITERATION_DONE = 8  # an elastic group's iteration (RunBatch) ended
    MIGRATE_DONE = 9  # a decoding request's KV moved between elastic instances (MigrateKV)
    OFFLOAD_DONE = 10  # an offloaded prompt's KV reached the host tier; its blocks on the group free
    RESHARD_DONE = 11  # a group switched parallel configuration (Reshard)


class EventQueue:
    """Events pop in (time, insertion order): equal times run in the order they were scheduled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, EventKind, Any]] = []
        self._seq = 0
        self.now = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, kind: EventKind, payload: Any = None) -> None:
        assert time >= self.now, f"event at {time} scheduled in the past (now {self.now})"
        heapq.heappush(self._heap, (time, self._seq, kind, payload))
        self._seq += 1

    def pop(self) -> tuple[float, EventKind, Any]:
        time, _, kind, payload = heapq.heappop(self._heap)
        assert time >= self.now, "the clock went backwards"
        self.now = time
        return time, kind, payload
