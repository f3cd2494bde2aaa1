"""The per-request choice of `spindle`: the cheapest prefill plan that meets the request's first-token deadline.

A candidate is a prefill plan (its chunks' SP sizes over time) on the instances that free up first, predicted with
the cost model from the live queues: when it ends (`finish`) and what it takes from the pool (`cost`: the
instance-seconds it reserves, from the moment each member would be free until the plan ends, so a member held
idle while a group assembles counts as used). The rule:

1. Among the candidates whose first token is predicted by the deadline, take the cheapest: it leaves the most of
   the pool to the requests that come next (what a request-level "fastest plan" rule gives away, Tetris §2.4).
   Ties go to the earlier finish.
2. A request may have a second, later deadline (the strategy's length-scaled one behind a service's fixed TTFT
   objective): when no candidate meets the first, rule 1 with the second. A request that misses its objective
   anyway should not take the pool from those that can still meet theirs.
3. When none meets any, the earliest finish: the later it ends, the longer it holds the queue behind it. (At
   arrival, strategy.py defers such a request when the work queued before it is the reason, and runs this plan on
   the instances left idle once it is released.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Steps = list[tuple[int, int, int]]  # (start, end, group size) per chunk


@dataclass(frozen=True)
class Candidate:
    finish: float  # predicted end of the prefill (the first token), absolute seconds
    steps: Steps
    cost: float  # instance-seconds reserved: sum over members of (finish - when the member is free)

    @property
    def size(self) -> int:
        return self.steps[-1][2]


def reserved_cost(ready: Sequence[float], finish: float, size: int) -> float:
    """Instance-seconds a plan ending at `finish` reserves on the `size` instances that free first (`ready`:
    when each is free, ascending)."""
    return sum(finish - ready[i] for i in range(size))


def candidate(ready: Sequence[float], finish: float, steps: Steps) -> Candidate:
    return Candidate(finish, steps, reserved_cost(ready, finish, steps[-1][2]))


def most_held(steps: Steps) -> int:
    """Prompt tokens a plan's first member holds at its end: its share of every chunk (the first take the rest)."""
    return sum(-(-(end - start) // size) for start, end, size in steps)


def choose(candidates: Sequence[Candidate], deadlines: Sequence[float]) -> Candidate:
    """Rule 1 for each deadline in turn, else rule 3 (module docstring)."""
    assert candidates, "no candidate plan"
    for deadline in deadlines:
        meeting = [c for c in candidates if c.finish <= deadline]
        if meeting:
            return min(meeting, key=lambda c: (c.cost, c.finish, c.size))
    return min(candidates, key=lambda c: (c.finish, c.cost, c.size))
