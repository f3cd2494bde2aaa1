"""How much of the prefill pool interactive traffic uses: the one live measure `spindle` shares out the rest by.

`InteractiveLoad` keeps an exponential average (over about `window_s` seconds) of how many prefill instances hold
interactive work (planned, queued or running), sampled at every arrival and tick. Two rules read it: a request's
SP group may only take the instances idle now beyond that average (strategy.py: the rest are what the next
arrivals will need; growing onto them is what made request-level SP collapse under load), and batch work may only
take what is idle beyond it (deferred.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...state import ClusterState, InstanceState


def interactive_busy(state: ClusterState, prefills: list[InstanceState], now: float) -> int:
    """Prefill instances with interactive work planned on them now."""
    return sum(
        any((req := state.requests.get(rid)) is not None and req.spec.service_class != "batch" for rid in i.planned)
        for i in prefills
        if i.busy_until(now) > now
    )


@dataclass
class InteractiveLoad:
    window_s: float = 30.0
    busy: float = 0.0
    _last: float | None = None

    def observe(self, state: ClusterState, prefills: list[InstanceState], now: float) -> float:
        """Sample the pool at `now`; the average so far."""
        busy = interactive_busy(state, prefills, now)
        if self._last is None:
            self.busy = float(busy)
        elif now > self._last:
            keep = math.exp(-(now - self._last) / self.window_s)
            self.busy = keep * self.busy + (1 - keep) * busy
        self._last = now
        return self.busy
