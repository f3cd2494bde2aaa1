"""Batch work in `spindle`: admitted at once, prefilled only on prefill instances interactive traffic leaves idle.

A batch request (`service_class="batch"`, a Batch API line) has no latency objective, only its job's completion
time. `plan()` admits it without a plan and queues it here (FIFO); on every tick and event the queue's head is
placed while more prefill instances are idle than interactive traffic needs. What it needs is measured, not
configured (load.py: the average number of prefill instances holding interactive work, rounded), and `reserve`
idle instances beyond that (default 1) stay free for the next arrival. A request waiting longer than
`max_wait_s` (0: never) is placed whatever the load, so a job always ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from spindle_protocol.messages import RequestSpec

from ...state import ClusterState, InstanceState
from .load import InteractiveLoad


@dataclass
class BatchQueue:
    reserve: int = 1  # idle prefill instances always left to interactive arrivals
    max_wait_s: float = 0.0
    load: InteractiveLoad = field(default_factory=InteractiveLoad)
    waiting: deque[tuple[RequestSpec, float]] = field(default_factory=deque)

    def add(self, spec: RequestSpec, now: float) -> None:
        self.waiting.append((spec, now))

    def spare(self, state: ClusterState, prefills: list[InstanceState], now: float) -> list[InstanceState]:
        """The idle prefill instances batch work may take now (most idle first), after the reserve."""
        need = round(self.load.observe(state, prefills, now)) + self.reserve
        idle = [i for i in prefills if i.busy_until(now) <= now]
        return idle[need:] if len(idle) > need else []

    def due(self, state: ClusterState, now: float) -> list[RequestSpec]:
        """Drop the requests that went away (aborted, ended); those waiting past `max_wait_s` come first."""
        self.waiting = deque((s, t) for s, t in self.waiting if s.request_id in state.requests)
        if self.max_wait_s <= 0:
            return []
        return [s for s, t in self.waiting if now - t >= self.max_wait_s]

    def pop(self, request_id: str) -> None:
        self.waiting = deque((s, t) for s, t in self.waiting if s.request_id != request_id)
