"""Work `spindle` admits at once but prefills later, on the prefill instances interactive traffic leaves idle.

Two kinds of request wait here, each in its own FIFO (`DeferredQueue`), late requests before batch work:
- batch work (`service_class="batch"`, a Batch API line): no latency objective, only its job's completion time;
- late requests: interactive ones no plan can serve by any of their deadlines at arrival (strategy.py, rule 4).
  They miss their objective whatever runs them; run now, they would take the pool from the requests behind them
  that can still meet theirs.

`plan()` admits such a request without a plan and queues it; on every tick and event a queue's head is placed while
more prefill instances are idle than interactive traffic needs. What it needs is measured, not configured (load.py:
the average number of prefill instances holding interactive work, rounded), and `reserve` idle instances beyond
that (default 1) stay free for the next arrival. A request waiting longer than `max_wait_s` (0: never) is placed
whatever the load, so every request ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from spindle_protocol.messages import RequestSpec

from ...state import ClusterState, InstanceState
from .load import InteractiveLoad


@dataclass
class DeferredQueue:
    reserve: int = 1  # idle prefill instances always left to interactive arrivals
    max_wait_s: float = 0.0
    load: InteractiveLoad = field(default_factory=InteractiveLoad)
    waiting: deque[tuple[RequestSpec, float]] = field(default_factory=deque)

    def add(self, spec: RequestSpec, now: float) -> None:
        self.waiting.append((spec, now))

    def spare(self, state: ClusterState, prefills: list[InstanceState], now: float) -> list[InstanceState]:
        """The idle prefill instances deferred work may take now (most idle first), after the reserve."""
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
