"""One CSA level's attention on an SP member (`csa_all_to_all`): which members send queries and keys at a level,
how many rows each keeps, and the attention of the level's queries over its keys, block by block as the members'
rows land (each query-member x key-member pair once; a query's partial states merged by log-sum-exp, exact)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..csa import CSALevels, masked_attention
from ..merge import merge_attn_states_many


def sends_queries(levels: CSALevels, level: int, member: int) -> bool:
    """Are there earlier keys in `member`'s level-`level` group outside its lower group?"""
    return levels.span(level - 1, member)[0] > levels.span(level, member)[0]


def sends_keys(levels: CSALevels, level: int, member: int) -> bool:
    """Are there later queries in `member`'s level-`level` group outside its lower group?"""
    return levels.span(level - 1, member)[1] < levels.span(level, member)[1]


def kept(levels: CSALevels, level: int, member: int, dense: bool) -> int:
    return levels.segments[member][1] - levels.segments[member][0] if dense else levels.kept_count(level, member)


class LevelAttention:
    """One level's attention on this member, for its query heads over the level group: the queries kept at the
    level against the keys kept there outside the query's lower group, attended block by block as the members'
    rows land (each query-member x key-member pair once), the partial states of a query merged by log-sum-exp."""

    def __init__(
        self,
        levels: CSALevels,
        level: int,
        me: int,
        q_heads: list[int],
        queries_per_kv: int,
        dense: bool,
        rows_of: Callable[[int, str, int, int], Tensor],
        scale: float,
        dev: torch.device,
    ) -> None:
        members = range(*levels.group(level, me))
        self.lower = {m: levels.group(level - 1, m)[0] for m in members}
        self.count = {m: kept(levels, level, m, dense) for m in members}
        self.queries = [m for m in members if sends_queries(levels, level, m)]
        self.keys = [m for m in members if sends_keys(levels, level, m)]
        assert not self.queries or self.keys, "a member with queries at a level has earlier keys there"
        self.q_heads, self.g, self.rows_of, self.scale, self.dev = q_heads, queries_per_kv, rows_of, scale, dev
        self.landed: list[int] = []
        self.parts: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = {}  # (member, head) -> (out, lse) states

    def add(self, block: list[int]) -> None:
        """The members of `block` have landed: their queries against every landed key, the earlier queries against
        their keys (with the whole group as one block: the level in one call per head)."""
        old = [m for m in self.landed if m in self.queries]
        self.landed += block
        keys = [m for m in self.landed if m in self.keys]
        self._attend([m for m in block if m in self.queries], keys)
        self._attend(old, [m for m in block if m in self.keys])

    def _attend(self, q_members: list[int], k_members: list[int]) -> None:
        q_members = [m for m in q_members if self.count[m]]
        k_members = [m for m in k_members if self.count[m]]
        if not q_members or not k_members:
            return
        q_lower = torch.cat([torch.full((self.count[m],), self.lower[m], device=self.dev) for m in q_members])
        k_lower = torch.cat([torch.full((self.count[m],), self.lower[m], device=self.dev) for m in k_members])
        for h in self.q_heads:
            kh = h // self.g
            q_pos = torch.cat([self.rows_of(m, "pos", kh, self.count[m]) for m in q_members])
            k_pos = torch.cat([self.rows_of(m, "pos", kh, self.count[m]) for m in k_members])
            mask = (k_pos[None, :] <= q_pos[:, None]) & (q_lower[:, None] != k_lower[None, :])  # [Tq, Tk]
            qs = torch.cat([self.rows_of(m, "q", h, self.count[m]) for m in q_members])
            ks = torch.cat([self.rows_of(m, "k", kh, self.count[m]) for m in k_members])
            vs = torch.cat([self.rows_of(m, "v", kh, self.count[m]) for m in k_members])
            o, lse, _ = masked_attention(qs[:, None], ks[:, None], vs[:, None], mask[None], self.scale)
            start = 0
            for m in q_members:
                c = self.count[m]
                self.parts.setdefault((m, h), []).append((o[start : start + c, 0], lse[0, start : start + c]))
                start += c

    def states(self) -> dict[int, list[tuple[Tensor, Tensor]]]:
        """Per member with queries at the level: its (out [c, D], lse [c]) per query head, the blocks merged."""
        out: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for m in self.queries:
            for h in self.q_heads:
                parts = self.parts.get((m, h), [])
                if len(parts) == 1:
                    state = parts[0]
                elif parts:
                    o, lse = merge_attn_states_many([p[0][:, None] for p in parts], [p[1][None] for p in parts])
                    state = (o[:, 0], lse[0])
                else:  # no kept row, or no kept key: an empty state
                    rows = self.rows_of(m, "q", h, self.count[m])  # [c, D]
                    state = (torch.zeros_like(rows), torch.full((rows.shape[0],), float("-inf"), device=rows.device))
                out.setdefault(m, []).append(state)
        return out
