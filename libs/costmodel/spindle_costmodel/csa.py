"""What CSPS's sparse attention (CSA) keeps, in numbers (no tensors): the share of causal attention pairs a prompt
attends, for `members` equal segments, `levels` levels and drop ratio `drop` at level 2 (doubling per level), as
`spindle_attention.csa` runs it (its bytes are measured by `spindle verify --csa-drop`, not modelled here).

Level 1 is a member's own segment (never dropped); level v >= 2 pairs a query member with the earlier members of
its level-v group outside its level-(v-1) group, both the query and the key kept at that level (a kept fraction
1 - min(1, 2^(v-2) p) each, so f^2 of those pairs). Groups are aligned blocks of 2^(v-1) members (the last level:
every member).
"""

from __future__ import annotations

import math


def max_levels(members: int) -> int:
    return 1 + math.ceil(math.log2(members)) if members > 1 else 1


def kept_fraction(level: int, drop: float) -> float:
    return 1.0 if level == 1 else 1.0 - min(1.0, drop * 2 ** (level - 2))


def _check(members: int, levels: int, drop: float) -> None:
    if members < 1 or not 1 <= levels <= max_levels(members) or not 0.0 <= drop < 1.0:
        raise ValueError(f"CSA over {members} members takes 1 to {max_levels(members)} levels and a drop in [0, 1), "
                         f"got {levels} and {drop}")  # fmt: skip


def _block(level: int, levels: int, member: int) -> int:
    """The first member of `member`'s level-`level` group."""
    if level >= levels:
        return 0
    size = 2 ** (level - 1)
    return member // size * size


def pair_fraction(members: int, levels: int, drop: float) -> float:
    """The share of a prompt's causal attention pairs CSA attends (1.0 with nothing dropped)."""
    _check(members, levels, drop)
    if levels == 1 or drop == 0.0:
        return 1.0
    kept = members * 0.5  # own segments' causal halves, in units of segment^2
    for q in range(members):
        for k in range(q):
            level = next(v for v in range(2, levels + 1) if _block(v, levels, k) == _block(v, levels, q))
            kept += kept_fraction(level, drop) ** 2
    return kept / (members * members * 0.5)
