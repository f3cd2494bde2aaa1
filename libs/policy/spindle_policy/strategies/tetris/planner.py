"""CDSP prefill scheduling (Tetris §5.1): Algorithm 1 (recursive chunk-plan search), Algorithm 2 (single-chunk
scheduling with the improvement-rate threshold), Algorithm 3 (chunk plan solving), Eq. 2 queue updates.

Pure: the planner sees queues (seconds until each prefill instance is free), nodes and Eq. 1's coefficients,
and returns chunks `(tokens, group)`; the strategy turns them into actions.

Queues are kept as they were at `now` plus the elapsed time D of the plan so far: Eq. 2 (T_i <- max(0, T_i -
(T_queue + T_prefill)) after each chunk, for every instance of the pool) is T_i(D) = max(0, T_i - D), the same
shift for all, which keeps the queue order and lets GetGroup's choices be cached (groups.py).

Choices the paper leaves open (options of the strategy):
- A chunk shorter than `min_chunk` tokens is illegal ("too short to yield benefits"), and chunk lengths are
  rounded down to multiples of `align` tokens (KV blocks stay whole on every member).
- Eq. 1 solved for the budget in closed form (the quadratic's positive root), not by Newton's method.
- The search keeps the plan with the earliest predicted first token; ties keep the single-chunk plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .groups import Group, GroupFinder

Coeffs = tuple[float, float, float, float]  # Eq. 1: a + b*L + c*C*L + d*L^2


@dataclass(frozen=True)
class CDSPPlan:
    chunks: tuple[tuple[int, Group], ...]  # (tokens, group) per chunk; each group extends the one before
    ttft_s: float  # predicted seconds from now until the last chunk ends


@dataclass(frozen=True)
class CDSPConfig:
    sizes: tuple[int, ...]  # SP size candidates, ascending
    improvement_rate: float = 0.3
    min_chunk: int = 1024
    align: int = 128
    chunking: bool = True  # False: Algorithm 2 alone (the paper's "single-chunk" ablation, Fig. 13)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"SP sizes must be ascending, distinct and >= 1, got {self.sizes}")
        if not 0 <= self.improvement_rate < 1:
            raise ValueError(f"improvement_rate must be in [0, 1), got {self.improvement_rate}")
        if self.min_chunk < 1 or self.align < 1:
            raise ValueError(f"min_chunk and align must be >= 1, got {self.min_chunk}, {self.align}")


class CDSPPlanner:
    """One request's plan over one pool: `queues` ascending (seconds; unchecked), `nodes[i]` instance i's node."""

    def __init__(
        self, config: CDSPConfig, coeffs: Mapping[int, Coeffs], queues: Sequence[float], nodes: Sequence[str]
    ) -> None:
        if missing := [s for s in config.sizes if s not in coeffs]:
            raise ValueError(f"no Eq. 1 coefficients for SP sizes {missing}")
        assert len(queues) == len(nodes)
        self.cfg, self.coeffs, self.queues, self.nodes = config, coeffs, list(queues), list(nodes)
        self.finders: dict[Group, GroupFinder] = {}
        self.rate = config.improvement_rate

    def _finder(self, pool: Group) -> GroupFinder:
        if pool not in self.finders:
            self.finders[pool] = GroupFinder(pool, self.nodes)
        return self.finders[pool]

    def _predict(self, s: int, history: float, tokens: float) -> float:
        a, b, c, d = self.coeffs[s]
        return max(0.0, a + b * tokens + c * history * tokens + d * tokens * tokens)

    def _wait(self, group: Group, elapsed: float) -> float:
        return max(0.0, self.queues[max(group)] - elapsed)  # the group's longest queue, after Eq. 2's shift

    def plan(self, tokens: int, with_sizes: Sequence[int] | None = None) -> CDSPPlan:
        """Algorithm 1 for a new request of `tokens` prompt tokens (SP sizes limited to `with_sizes`)."""
        if tokens < 1:
            raise ValueError(f"a prompt needs >= 1 token, got {tokens}")
        sizes = tuple(s for s in (with_sizes or self.cfg.sizes) if s <= len(self.queues))
        if not sizes:
            raise ValueError(f"no SP size fits {len(self.queues)} prefill instances")
        pool = tuple(range(len(self.queues)))
        self.finders[pool] = GroupFinder(range(len(self.queues)), self.nodes)
        ttft, chunks = self._search(self.finders[pool], tokens, 0, (), sizes, 0.0)
        return CDSPPlan(chunks, ttft)

    def _single(self, finder: GroupFinder, tokens: int, history: int, initial: Group, sizes: Sequence[int],
                elapsed: float) -> Group | None:  # fmt: skip
        """Algorithm 2: the group of the first size that beats the best so far by the improvement rate."""
        best_ttft, best = math.inf, None
        for s in sizes:
            group = finder.get(initial, s)
            if group is None:
                continue
            ttft = self._wait(group, elapsed) + self._predict(s, history, tokens)
            if ttft < best_ttft * (1 - self.rate):
                best_ttft, best = ttft, group
        return best

    def _search(
        self, finder: GroupFinder, tokens: int, history: int, done: tuple[tuple[int, Group], ...],
        sizes: Sequence[int], elapsed: float,
    ) -> tuple[float, tuple[tuple[int, Group], ...]]:  # fmt: skip
        """Algorithm 1 from `elapsed` seconds on, `done` chunks planned, `tokens` left after `history`."""
        initial = done[-1][1] if done else ()
        group = self._single(finder, tokens, history, initial, sizes, elapsed)
        if group is None:  # no size extends `initial` inside this pool
            return math.inf, done
        best = (elapsed + self._wait(group, elapsed) + self._predict(len(group), history, tokens),
                (*done, (tokens, group)))  # fmt: skip
        if not self.cfg.chunking:
            return best
        candidates = [s for s in sizes if s <= len(group)]
        if len(candidates) < 2:
            return best
        sub = self._finder(tuple(sorted(group)))  # later chunks stay inside the single-chunk allocation
        for i, current in enumerate(candidates):
            for nxt in candidates[i + 1 :]:
                step = self._chunk(sub, tokens, history, initial, current, nxt, elapsed)
                if step is None:
                    continue
                length, cur_group, spent = step
                chunk = (length, cur_group)
                if length == tokens:
                    found = (elapsed + spent, (*done, chunk))
                else:
                    rest = [s for s in candidates if s >= nxt]
                    found = self._search(sub, tokens - length, history + length, (*done, chunk), rest,
                                         elapsed + spent)  # fmt: skip
                if found[0] < best[0]:
                    best = found
        return best

    def _chunk(
        self, finder: GroupFinder, tokens: int, history: int, initial: Group, current: int, nxt: int,
        elapsed: float,
    ) -> tuple[int, Group, float] | None:  # fmt: skip
        """Algorithm 3: the chunk `current` can compute before the `nxt`-sized group is free, or None (illegal)."""
        cur = finder.get(initial, current)
        if cur is None:
            return None
        after = finder.get(cur, nxt)
        if after is None:
            return None
        wait = self._wait(cur, elapsed)
        budget = self._wait(after, elapsed) - wait
        length = min(tokens, self._solve(current, history, budget))
        if length < tokens:
            length -= length % self.cfg.align
        if length < min(self.cfg.min_chunk, tokens) or length <= 0:
            return None
        return length, cur, wait + self._predict(current, history, length)

    def _solve(self, s: int, history: int, budget: float) -> int:
        """The most tokens Eq. 1 fits in `budget` seconds after `history` tokens (0 if none)."""
        a, b, c, d = self.coeffs[s]
        rest, slope = budget - a, b + c * history
        if rest <= 0:
            return 0
        if d <= 0:
            return int(rest / slope) if slope > 0 else 1 << 40
        return int((-slope + math.sqrt(slope * slope + 4 * d * rest)) / (2 * d))
