"""When the launcher restarts a dead process, and when it gives up (pure logic; the Stack acts on it).

A unit is what restarts together: one instance's processes (a TP group's leader and followers share state, so the
death of any one of them restarts all of them), or one singleton service. Back-off doubles per restart within the
crash-loop window, from `backoff_s` up to `backoff_max_s`; `max_restarts` restarts within `window_s` is a crash
loop, and the unit stays down (Kubernetes' CrashLoopBackOff, minus the endless retry: a user should see it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Without these nothing is served: giving up on one stops the stack (an instance left down leaves the rest serving).
ESSENTIAL = ("nats", "rendezvous", "kvstore-0", "scheduler", "gateway")


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"need 0 <= backoff_s <= backoff_max_s, got {self.backoff_s}, {self.backoff_max_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


@dataclass
class UnitHistory:
    """One unit's restarts (monotonic times) and whether the launcher gave up on it."""

    restarts: list[float] = field(default_factory=list)
    gave_up: bool = False

    def delay(self, policy: RestartPolicy, now: float) -> float | None:
        """Seconds to wait before restarting after a death at `now`, or None for a crash loop (give up)."""
        recent = [t for t in self.restarts if now - t < policy.window_s]
        if len(recent) >= policy.max_restarts:
            return None
        return min(policy.backoff_s * 2 ** len(recent), policy.backoff_max_s)


DEFAULT_RESTART = RestartPolicy()
