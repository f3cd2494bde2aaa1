"""Tetris's node-aware instance-group extension (`GetGroup`, §5.1), over a pool of prefill instances.

Every instance has a queue: the predicted seconds until the work already planned on it is done. The pool's
instances are indexed 0..n-1 in queue order (shortest first, rank breaking ties), so a smaller index always means
a queue no longer. Tetris's queue updates (Eq. 2) subtract the same elapsed time from every queue and clamp at 0,
which keeps that order: a group chosen once stays the right choice later, and `GroupFinder` caches it.
"""

from __future__ import annotations

from collections.abc import Sequence

Group = tuple[int, ...]  # pool indices, in the order members joined (each chunk's group extends the last)


class GroupFinder:
    """GetGroup over the pool instances `members` (indices); `node_of[i]` is instance i's node."""

    def __init__(self, members: Sequence[int], node_of: Sequence[str]) -> None:
        self.by_node: dict[str, list[int]] = {}
        for i in members if isinstance(members, range) else sorted(members):
            self.by_node.setdefault(node_of[i], []).append(i)  # ascending index = ascending queue
        self.node_of = node_of
        self.size = len(members)
        # nodes by their longest queue (a whole node waits for its last member), bigger nodes first on ties
        self.whole_order = sorted(self.by_node, key=lambda n: (self.by_node[n][-1], -len(self.by_node[n])))
        self._cache: dict[tuple[Group, int], Group | None] = {}

    def get(self, initial: Group, s: int) -> Group | None:
        """`initial` extended to `s` instances (None when the pool has too few, or s < len(initial)).

        Empty `initial`: within one node when s fits one (the node whose s-th shortest queue is smallest, its s
        shortest-queued instances); else the k whole nodes with the shortest queues (a whole node waits for its
        longest) and the rest as from one node among the others. Otherwise: first the free instances on the
        nodes `initial` uses (shortest queues first), then as for an empty group on the remaining nodes."""
        key = (initial, s)
        if key not in self._cache:
            self._cache[key] = self._get(initial, s)
        return self._cache[key]

    def _get(self, initial: Group, s: int) -> Group | None:
        if s < len(initial) or s > self.size:
            return None
        need = s - len(initial)
        if not need:
            return initial
        used: set[str] = set()
        added: list[int] = []
        if initial:
            taken = set(initial)
            used = {self.node_of[i] for i in initial}
            near = sorted(i for node in used for i in self.by_node[node] if i not in taken)
            added = near[:need]
            need -= len(added)
        if need:
            added += self._from_nodes(used, need)
        return initial + tuple(added)

    def _from_nodes(self, exclude: set[str], need: int) -> list[int]:
        """`need` instances from the nodes not in `exclude` (none of their instances is taken yet)."""
        order = [n for n in self.whole_order if n not in exclude]
        out: list[int] = []
        while need > 0:
            best: list[int] | None = None
            for node in order:  # the node whose need-th shortest queue is the smallest
                members = self.by_node[node]
                if len(members) >= need and (best is None or members[need - 1] < best[need - 1]):
                    best = members
            if best is not None:
                return out + best[:need]
            # more than any node holds: the whole node with the shortest queue, then again
            members = self.by_node[order.pop(0)]
            out += members
            need -= len(members)
        return out
