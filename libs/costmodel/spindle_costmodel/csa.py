"""What CSPS's sparse attention (CSA) keeps, in numbers (no tensors): the share of causal attention pairs a prompt
attends, for `members` equal segments, `levels` levels and drop ratio `drop` at level 2 (doubling per level), as
`spindle_attention.csa` runs it, and the bytes its all-to-all sends (`alltoall_bytes`, as
`spindle_attention.distributed.csa_all_to_all` sends them; `spindle verify --csa-drop` measures them).

Level 1 is a member's own segment (never dropped); level v >= 2 pairs a query member with the earlier members of
its level-v group outside its level-(v-1) group, both the query and the key kept at that level (a kept fraction
1 - min(1, 2^(v-2) p) each, so f^2 of those pairs). Groups are aligned blocks of 2^(v-1) members (the last level:
every member).
"""

from __future__ import annotations

import itertools
import math


def max_levels(members: int) -> int:
    return 1 + math.ceil(math.log2(members)) if members > 1 else 1


CSA_RULES = ("doubling", "printed")  # as `spindle_attention.csa`: the drop doubles per level / the printed formula


def kept_fraction(level: int, drop: float, rule: str = "doubling") -> float:
    if level == 1:
        return 1.0
    if rule == "printed":
        return min(1.0, (1.0 - drop) * 2 ** (level - 2))
    return 1.0 - min(1.0, drop * 2 ** (level - 2))


def _check(members: int, levels: int, drop: float, rule: str = "doubling") -> None:
    if members < 1 or not 1 <= levels <= max_levels(members) or not 0.0 <= drop < 1.0:
        raise ValueError(f"CSA over {members} members takes 1 to {max_levels(members)} levels and a drop in [0, 1), "
                         f"got {levels} and {drop}")  # fmt: skip
    if rule not in CSA_RULES:
        raise ValueError(f"the CSA level rule must be one of {', '.join(CSA_RULES)}, got {rule!r}")


def _block(level: int, levels: int, member: int) -> int:
    """The first member of `member`'s level-`level` group."""
    if level >= levels:
        return 0
    size = 2 ** (level - 1)
    return member // size * size


def pair_fraction(members: int, levels: int, drop: float, rule: str = "doubling") -> float:
    """The share of a prompt's causal attention pairs CSA attends (1.0 with nothing dropped)."""
    _check(members, levels, drop, rule)
    if levels == 1 or drop == 0.0:
        return 1.0
    kept = members * 0.5  # own segments' causal halves, in units of segment^2
    for q in range(members):
        for k in range(q):
            level = next(v for v in range(2, levels + 1) if _block(v, levels, k) == _block(v, levels, q))
            kept += kept_fraction(level, drop, rule) ** 2
    return kept / (members * members * 0.5)


def _runs(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` runs whose lengths differ by at most one (longer first), as Ulysses splits heads."""
    base, extra = divmod(n, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(starts))


def _head_runs(q_heads: int, kv_heads: int, size: int, index: int) -> tuple[range, range]:
    """(query heads, KV heads) member `index` of a head-split group of `size` computes (its KV heads cover its
    query heads' groups: replicated where a group's query heads land on several members)."""
    qs, qe = _runs(q_heads, size)[index]
    per_kv = q_heads // kv_heads
    return (range(qs, qe), range(qs // per_kv, (qe - 1) // per_kv + 1)) if qe > qs else (range(0), range(0))


def alltoall_bytes(
    tokens: int,
    members: int,
    levels: int,
    drop: float,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    elem: int,
    rule: str = "doubling",
) -> float:
    """Bytes one layer's SP attention sends over all members of an all-to-all (Ulysses) group, `tokens` in equal
    segments: with one level plain Ulysses (every member's q, k, v and positions to each member for its heads, the
    outputs and log-sum-exps back); with CSA per level v >= 2, within each level group, keys (k, v, positions) from
    the members with later queries outside their lower group, queries from those with earlier keys there, only the
    rows kept at the level and each row once over the levels (a member's kept rows are a prefix), the outputs of
    the queries back. Level 1 (a member's own segment) sends nothing."""
    _check(members, levels, drop, rule)
    seg, row = tokens / members, head_dim * elem
    if levels == 1:
        total = 0.0
        for dst in range(members):
            qh, kh = _head_runs(q_heads, kv_heads, members, dst)
            nq, nk = len(qh), len(kh)
            fwd = 2 * 8 * seg + row * seg * (nq + 2 * nk)
            total += (members - 1) * (fwd + (4 + row) * seg * nq)
        return total
    total, per_kv = 0.0, q_heads // kv_heads
    for src in range(members):
        sent: dict[tuple[int, str, int], float] = {}  # (dst, kind, head) -> rows sent so far
        for v in range(2, levels + 1):
            first = _block(v, levels, src)
            size = members if v >= levels else min(2 ** (v - 1), members - first)
            lower = _block(v - 1, levels, src)
            lower_size = min(2 ** (v - 2), members - lower)
            with_keys = lower + lower_size < first + size  # later queries in the group, outside the lower group
            with_queries = lower > first  # earlier keys there
            n = kept_fraction(v, drop, rule) * seg
            for dst in range(first, first + size):
                if dst == src:
                    continue
                qh, kvh = _head_runs(q_heads, kv_heads, size, dst - first)
                need: dict[tuple[str, int], float] = {}
                if with_keys:
                    for kh in kvh:
                        need["k", kh] = need["v", kh] = need["pos", kh] = n
                if with_queries:
                    for h in qh:
                        need["q", h] = n
                        need["pos", h // per_kv] = max(need.get(("pos", h // per_kv), 0.0), n)
                    total += len(qh) * n * (4 + row)  # the outputs back
                for (kind, head), end in need.items():
                    start = sent.get((dst, kind, head), 0.0)
                    if end > start:
                        total += (end - start) * (8 if kind == "pos" else row)
                        sent[dst, kind, head] = end
    return total
