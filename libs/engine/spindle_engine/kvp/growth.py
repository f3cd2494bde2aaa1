"""Whether every request of a KVP group can still grow to its committed size (pure).

A request's new tokens go to its tail, and when the tail fills, to a member that holds none of it (scale-up:
existing KV never moves). So a request can only use the free blocks of its tail and of the members it does not
hold yet: free blocks on its other holders are of no use to it. A group-wide count of free blocks can then say
"room" while a request will get stuck. This is a transport problem: requests demand blocks, members supply them,
each request reaches only some members; all demands can be met iff the maximum flow saturates them. Groups have a
handful of members, so the flow is small.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def demands_fit(demands: Sequence[tuple[int, Sequence[int]]], free: dict[int, int]) -> bool:
    """`demands`: (blocks, the members that may hold them) per request; `free`: free blocks per member."""
    need = [blocks for blocks, _ in demands]
    if sum(need) > sum(max(0, f) for f in free.values()):
        return False
    members = sorted(free)
    left = {m: max(0, free[m]) for m in members}  # supply not yet used
    flow: list[dict[int, int]] = [dict.fromkeys(reach, 0) for _, reach in demands]  # request -> member -> blocks
    for r in range(len(demands)):
        while need[r] > 0:
            path = _augmenting_path(r, demands, flow, left)
            if path is None:
                return False
            amount = need[r]
            for req, member, sign in path:
                if sign < 0:
                    amount = min(amount, flow[req][member])
            amount = min(amount, left[path[-1][1]])
            for req, member, sign in path:
                flow[req][member] += sign * amount
            left[path[-1][1]] -= amount
            need[r] -= amount
    return True


def _augmenting_path(
    start: int,
    demands: Sequence[tuple[int, Sequence[int]]],
    flow: list[dict[int, int]],
    left: dict[int, int],
) -> list[tuple[int, int, int]] | None:
    """Request `start` -> member -> (request it serves -> another member)* -> a member with supply left, as
    (request, member, +1 take / -1 give back) steps; BFS, so shortest first."""
    seen_members: set[int] = set()
    seen_requests = {start}
    queue: deque[tuple[int, list[tuple[int, int, int]]]] = deque([(start, [])])
    while queue:
        req, path = queue.popleft()
        for m in demands[req][1]:
            if m in seen_members or m not in left:
                continue
            seen_members.add(m)
            step = [*path, (req, m, +1)]
            if left[m] > 0:
                return step
            for other, used in enumerate(flow):  # free m by moving one of its requests elsewhere
                if other not in seen_requests and used.get(m, 0) > 0:
                    seen_requests.add(other)
                    queue.append((other, [*step, (other, m, -1)]))
    return None
