"""CSPS's sparse attention (CSA) on an SP plan: the levels over a one-chunk all-to-all plan's members, and what it
drops. Every member (and the decode side, for usage) derives the same answer from the plan alone."""

from __future__ import annotations

from spindle_attention.csa import CSALevels, max_levels

from .plan import SPPlan


def csa_levels_for(plan: SPPlan, drop: float, levels: int | None = None, rule: str = "doubling") -> CSALevels:
    """The levels over the plan's members' segments, in member order (ValueError for a plan CSA cannot run)."""
    chunks = plan.chunks
    if len(chunks) != 1 or chunks[0].layout != "all-to-all" or chunks[0].sp < 2:
        raise ValueError(f"CSA needs a one-chunk all-to-all plan over 2 or more members, got {plan.format()}")
    shards = chunks[0].shard_positions()
    if any(p.numel() == 0 for p in shards):
        raise ValueError(f"CSA needs a token on every member: {plan.num_tokens} tokens over {chunks[0].sp}")
    segments = tuple((int(p[0]), int(p[-1]) + 1) for p in shards)
    return CSALevels(segments, levels if levels is not None else max_levels(len(segments)), drop, rule)


def dropped_at_level2(levels: CSALevels, member: int) -> int:
    """Tokens of `member`'s segment dropped at level 2 (in every dropping layer, for every head)."""
    if levels.num_levels < 2:
        return 0
    s, e = levels.segments[member]
    return e - s - levels.kept_count(2, member)


def csa_dropped_tokens(plan: SPPlan, drop: float, levels: int | None = None, rule: str = "doubling") -> int:
    """The prompt's tokens dropped at level 2 over every member (what a response's usage reports)."""
    csa = csa_levels_for(plan, drop, levels, rule)
    return sum(dropped_at_level2(csa, m) for m in range(len(csa.segments)))
