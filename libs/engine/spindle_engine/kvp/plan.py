"""KV-parallel (KVP) placement: which decode member holds which token range of each request's KV.

A request's KV (every layer, every head) is split by token ranges over several decode members, e.g.
member 0 holds `[0, 413)` and member 1 holds `[413, 1001)`; the ranges need not fall on block
boundaries. New tokens are appended to the last range (the *tail*); scale-up opens a new, empty range on
another member, which becomes the tail, so existing KV never moves (LoongServe §4.2, Medha §3.5). The
request's *master* runs its linears, MLP, logits and sampling and merges the holders' partial attention.

Scale-down is the one operation that moves KV: a holder leaves and its range merges into an adjacent holder's
(the one before it, or after it when it holds the first range; `into` picks either). The receiver's range grows
at its end, or at its front (then it lays its own KV out again after the received tokens), so every member still
stores its range from local slot 0. A tail that leaves makes the receiver the tail. The master is not a holder
role: a master that leaves keeps mastering with no KV of its own (as a master placed without KV does). A request
keeps at least one range.

Everything here is pure and shared: every member applies the same `append` / `scale_up` / `scale_down` /
`finish` calls in the same step order, so all of them agree on every message size without exchanging metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise


@dataclass(frozen=True)
class KVRange:
    member: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class KVPRequest:
    """One request's KV placement. `ranges` tile `[0, num_tokens)` in order; only the tail may be empty."""

    request_id: str
    master: int
    ranges: tuple[KVRange, ...]

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ValueError(f"request {self.request_id!r} has no KV range")
        if self.ranges[0].start != 0:
            raise ValueError(f"request {self.request_id!r}: the first range must start at token 0")
        for prev, cur in pairwise(self.ranges):
            if cur.start != prev.end:
                raise ValueError(f"request {self.request_id!r}: ranges must tile the tokens ({prev} then {cur})")
        for r in self.ranges[:-1]:
            if r.num_tokens <= 0:
                raise ValueError(f"request {self.request_id!r}: only the tail range may be empty ({r})")
        if self.ranges[-1].num_tokens < 0:
            raise ValueError(f"request {self.request_id!r}: negative range {self.ranges[-1]}")
        members = [r.member for r in self.ranges]
        if len(set(members)) != len(members) or min(members) < 0:
            raise ValueError(f"request {self.request_id!r}: holders {members} must be distinct non-negative members")
        if self.master < 0:
            raise ValueError(f"request {self.request_id!r}: master must be a non-negative member")

    @classmethod
    def split(cls, request_id: str, master: int, members: list[int], bounds: list[int]) -> KVPRequest:
        """Ranges `[bounds[i], bounds[i+1])` on `members[i]`; `bounds` has one more entry than `members`."""
        if len(bounds) != len(members) + 1:
            raise ValueError(f"{len(members)} members need {len(members) + 1} bounds, got {bounds}")
        pairs = pairwise(bounds)
        return cls(request_id, master, tuple(KVRange(m, a, b) for m, (a, b) in zip(members, pairs, strict=True)))

    @property
    def num_tokens(self) -> int:
        return self.ranges[-1].end

    @property
    def tail(self) -> int:
        return self.ranges[-1].member

    @property
    def holders(self) -> tuple[int, ...]:
        """Members that hold at least one token, in range order."""
        return tuple(r.member for r in self.ranges if r.num_tokens > 0)

    def range_of(self, member: int) -> KVRange | None:
        return next((r for r in self.ranges if r.member == member), None)

    def append(self, n: int = 1) -> KVPRequest:
        """`n` new tokens at the tail."""
        if n < 1:
            raise ValueError(f"append needs n >= 1, got {n}")
        tail = self.ranges[-1]
        return replace(self, ranges=(*self.ranges[:-1], replace(tail, end=tail.end + n)))

    def scale_up(self, member: int) -> KVPRequest:
        """`member` becomes the tail with an empty range; the next tokens go to it."""
        if self.range_of(member) is not None:
            raise ValueError(f"member {member} already holds a range of {self.request_id!r}")
        if self.ranges[-1].num_tokens == 0:
            raise ValueError(f"the tail of {self.request_id!r} (member {self.tail}) has not received a token yet")
        n = self.num_tokens
        return replace(self, ranges=(*self.ranges, KVRange(member, n, n)))

    def scale_down_target(self, member: int, into: int | None = None) -> int:
        """The holder that takes `member`'s range: `into` (an adjacent holder), else the one before it, else the
        one after it (when `member` holds the first range)."""
        i = next((i for i, r in enumerate(self.ranges) if r.member == member), None)
        if i is None:
            raise ValueError(f"member {member} holds no range of {self.request_id!r}")
        if len(self.ranges) == 1:
            raise ValueError(f"member {member} is the only holder of {self.request_id!r}; a request keeps one")
        adjacent = [self.ranges[j].member for j in (i - 1, i + 1) if 0 <= j < len(self.ranges)]
        if into is None:
            return adjacent[0]
        if into not in adjacent:
            raise ValueError(f"member {into} does not hold a range next to member {member}'s in {self.request_id!r}")
        return into

    def scale_down(self, member: int, into: int | None = None) -> KVPRequest:
        """`member` leaves: its range merges into the adjacent holder `scale_down_target(member, into)`."""
        target = self.scale_down_target(member, into)
        gone, kept = self.range_of(member), self.range_of(target)
        assert gone is not None and kept is not None
        merged = KVRange(target, min(gone.start, kept.start), max(gone.end, kept.end))
        ranges = tuple(merged if r.member == target else r for r in self.ranges if r.member != member)
        return replace(self, ranges=ranges)


class KVPPlan:
    """The placement of every active request over a lockstep group of decode members.

    Requests keep their admission order; that order fixes the layout of every message between members.
    """

    def __init__(self, members: list[int]) -> None:
        if not members or len(set(members)) != len(members) or min(members) < 0:
            raise ValueError(f"a KVP group needs distinct non-negative members, got {members}")
        self.members: tuple[int, ...] = tuple(members)
        self.requests: dict[str, KVPRequest] = {}

    def _check(self, req: KVPRequest) -> None:
        outside = {req.master, *(r.member for r in req.ranges)} - set(self.members)
        if outside:
            raise ValueError(f"request {req.request_id!r} names members {sorted(outside)} outside {self.members}")

    def add(self, req: KVPRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already placed")
        self._check(req)
        self.requests[req.request_id] = req

    def get(self, request_id: str) -> KVPRequest:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        return req

    def append(self, request_id: str, n: int = 1) -> KVPRequest:
        self.requests[request_id] = self.get(request_id).append(n)
        return self.requests[request_id]

    def scale_up(self, request_id: str, member: int) -> KVPRequest:
        req = self.get(request_id).scale_up(member)
        self._check(req)
        self.requests[request_id] = req
        return req

    def scale_down(self, request_id: str, member: int, into: int | None = None) -> KVPRequest:
        self.requests[request_id] = self.get(request_id).scale_down(member, into)
        return self.requests[request_id]

    def finish(self, request_id: str) -> KVPRequest:
        return self.requests.pop(request_id)

    def mastered_by(self, member: int) -> list[KVPRequest]:
        return [r for r in self.requests.values() if r.master == member]

    def served(self, master: int, holder: int) -> list[KVPRequest]:
        """Requests `master` masters that `holder` holds tokens of: the rows of one query message."""
        return [r for r in self.requests.values() if r.master == master and holder in r.holders]


def proportional_bounds(num_tokens: int, weights: list[int]) -> list[int]:
    """Split `[0, num_tokens)` into consecutive ranges proportional to `weights` (each at least one token)."""
    if not weights or min(weights) < 1:
        raise ValueError(f"weights must be positive integers, got {weights}")
    if num_tokens < len(weights):
        raise ValueError(f"{num_tokens} tokens cannot be split over {len(weights)} members")
    total = sum(weights)
    bounds, acc = [0], 0
    for i, w in enumerate(weights[:-1]):
        acc += w
        lo = bounds[-1] + 1
        hi = num_tokens - (len(weights) - 1 - i)
        bounds.append(min(max(num_tokens * acc // total, lo), hi))
    return [*bounds, num_tokens]


def parse_bounds(text: str, num_tokens: int) -> list[int]:
    """`'0,413,700'` (range starts) -> `[0, 413, 700, num_tokens]`, checked to be increasing from 0."""
    try:
        starts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"a KV split is comma-separated token offsets, got {text!r}") from None
    bounds = [*starts, num_tokens]
    if starts[0] != 0 or any(b <= a for a, b in pairwise(bounds)):
        raise ValueError(f"a KV split must start at 0 and increase below {num_tokens}, got {text!r}")
    return bounds
