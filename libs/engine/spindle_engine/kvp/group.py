"""Where a KVP decode group puts each request (pure): Medha-style placement, multi-master, scale-up.

The group's leader owns one `GroupPlanner` over the shared `KVPPlan` (the one its `KVPMember` steps with).
Every member allocates a range `[start, end)` from its local slot 0, so the blocks each member uses follow
from the plan alone: `ceil(tokens / block_size)` per range, plus what reservations hold. That lets the
leader place requests and decide scale-ups for every member without asking, and check the followers'
reported block counts against it.

- `reserve(rid, n)`: a request whose prompt exceeds `kvp_tokens` (the per-member KV token limit; 0 = no
  limit, one member when one has room) is split into consecutive ranges of at most that many tokens over
  `ceil(n / kvp_tokens)` members, those with the most free blocks first; ranges need not fall on block
  boundaries. When the limit would need more members than the group has, or they lack room, ranges are cut
  by free space instead. The last range (the tail, which takes new tokens) goes to the member left with the
  most free blocks, and there must be room for the first decoded token.
- The master is the member mastering the fewest requests (ties: the tail, then other holders, then the
  lowest member), so different members run different requests' layers.
- `scale_ups()` before each step: a tail member whose requests' next tokens need more blocks than it has
  free hands the tails of some of them to the member with the most free blocks that holds no range of that
  request yet (LoongServe's scale-up: existing KV never moves). A request no member can take is `stuck`.
- Growth is committed: each placed request's KV may still grow to `final_tokens` (its max_tokens, set by
  `commit` when it joins), and a new reservation must leave the group enough free blocks for that growth of
  every placed request, so admitting one request does not leave the ones decoding without room (there is no
  preemption inside a group: a stuck request fails). A refused reservation waits (the service parks it).
- `mark_dead(m)`: a member that died leaves the group for good: nothing is placed there again, the group's
  blocks shrink by its share, and reservations that used it are placed again on the others (or fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import KVPPlan, KVPRequest, KVRange


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class GroupConfig:
    num_members: int
    blocks_per_member: int
    block_size: int = 16
    kvp_tokens: int = 0  # per-member KV token limit of a new request's ranges; 0 = none

    def __post_init__(self) -> None:
        if self.num_members < 1 or self.blocks_per_member < 1 or self.block_size < 1:
            raise ValueError(f"a KVP group needs members, blocks and a block size >= 1, got {self}")
        if self.kvp_tokens < 0:
            raise ValueError(f"kvp_tokens must be >= 0, got {self.kvp_tokens}")

    @property
    def num_blocks(self) -> int:
        return self.num_members * self.blocks_per_member


@dataclass(frozen=True)
class ScaleUps:
    moves: list[tuple[str, int]] = field(default_factory=list)  # (request, new tail member), in plan order
    stuck: list[str] = field(default_factory=list)  # requests whose next token has no room anywhere


class GroupPlanner:
    def __init__(self, config: GroupConfig, plan: KVPPlan) -> None:
        if plan.members != tuple(range(config.num_members)):
            raise ValueError(f"the plan's members {plan.members} are not 0..{config.num_members - 1}")
        self.config = config
        self.plan = plan
        self.reserved: dict[str, KVPRequest] = {}  # placed at reserve time; not in the plan until resumed
        self.final_tokens: dict[str, int] = {}  # placed request -> most KV tokens it may reach
        self.scale_up_count = 0
        self.dead: set[int] = set()  # members gone for good

    @property
    def live_members(self) -> tuple[int, ...]:
        return tuple(m for m in self.plan.members if m not in self.dead)

    @property
    def num_blocks(self) -> int:
        """The live members' blocks (what the instance registers)."""
        return len(self.live_members) * self.config.blocks_per_member

    # ---- block accounting ----

    def _range_blocks(self, r: KVRange) -> int:
        return _blocks(r.num_tokens, self.config.block_size)

    def placed_blocks(self, member: int) -> int:
        """Blocks `member` holds for the requests in the plan (what its allocator reports)."""
        return sum(self._range_blocks(r) for q in self.plan.requests.values() for r in q.ranges if r.member == member)

    def used_blocks(self, member: int) -> int:
        reserved = sum(self._range_blocks(r) for q in self.reserved.values() for r in q.ranges if r.member == member)
        return self.placed_blocks(member) + reserved

    def free_blocks(self, member: int) -> int:
        return 0 if member in self.dead else self.config.blocks_per_member - self.used_blocks(member)

    def request_blocks(self, request_id: str) -> int:
        req = self.plan.requests.get(request_id) or self.reserved.get(request_id)
        return 0 if req is None else sum(self._range_blocks(r) for r in req.ranges)

    @property
    def num_used(self) -> int:
        return sum(self.used_blocks(m) for m in self.live_members)

    def growth_blocks(self) -> int:
        """Blocks the placed requests may still take as they decode (one more each for a scale-up's new range)."""
        bs, out = self.config.block_size, 0
        for rid, q in self.plan.requests.items():
            left = self.final_tokens.get(rid, q.num_tokens) - q.num_tokens
            if left > 0:
                n = q.ranges[-1].num_tokens
                out += _blocks(n + left, bs) - _blocks(n, bs) + 1
        return out

    # ---- placement ----

    def place(self, request_id: str, num_tokens: int) -> KVPRequest | None:
        """The placement of a new request's `num_tokens` tokens of KV, or None when the group has no room
        for them and for the first token decoded after them."""
        if num_tokens < 1:
            raise ValueError(f"cannot place {num_tokens} tokens")
        bs = self.config.block_size
        live = self.live_members
        free = {m: self.free_blocks(m) * bs for m in live}  # tokens
        order = sorted(live, key=lambda m: (-free[m], m))
        limit = self.config.kvp_tokens or num_tokens
        cuts = _cut(num_tokens, order, {m: min(limit, free[m]) for m in order})
        if cuts is None and self.config.kvp_tokens:
            cuts = _cut(num_tokens, order, free)  # the limit cannot be met: fill by free space
        if cuts is None:
            return None
        left = {m: self.free_blocks(m) - _blocks(n, bs) for m, n in cuts}
        cuts.sort(key=lambda c: left[c[0]])  # the tail, which grows, where the most blocks stay free (stable)
        if not self._next_token_fits(cuts):
            return None
        members = [m for m, _ in cuts]
        bounds = [0]
        for _, n in cuts:
            bounds.append(bounds[-1] + n)
        tail = members[-1]
        mastering = dict.fromkeys(live, 0)
        for q in (*self.plan.requests.values(), *self.reserved.values()):
            if q.master in mastering:
                mastering[q.master] += 1
        master = min(live, key=lambda m: (mastering[m], m != tail, m not in members, m))
        return KVPRequest.split(request_id, master, members, bounds)

    def _next_token_fits(self, cuts: list[tuple[int, int]]) -> bool:
        """Room for the first decoded token: in the tail's last block, a free block there, or one elsewhere
        (a member holding none of the request, which a scale-up would make the tail)."""
        bs = self.config.block_size
        tail, n = cuts[-1]
        if _blocks(n + 1, bs) == _blocks(n, bs):
            return True
        left = {m: self.free_blocks(m) for m in self.live_members}
        for m, k in cuts:
            left[m] -= _blocks(k, bs)
        holders = {m for m, _ in cuts}
        return left[tail] >= 1 or any(left[m] >= 1 for m in self.live_members if m not in holders)

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        if request_id in self.reserved or request_id in self.plan.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.place(request_id, num_tokens)
        if req is None:
            return False
        free = self.num_blocks - self.num_used - sum(self._range_blocks(r) for r in req.ranges)
        if free < self.growth_blocks():
            return False
        self.reserved[request_id] = req
        return True

    def commit(self, request_id: str, final_tokens: int) -> None:
        """A placed request's KV may grow to `final_tokens` tokens (its output budget)."""
        self.final_tokens[request_id] = final_tokens

    def forget(self, request_id: str) -> None:
        """A request left the plan (finished or dropped)."""
        self.final_tokens.pop(request_id, None)

    def take_reservation(self, request_id: str, num_tokens: int) -> KVPRequest:
        """The reserved placement, to be added to the plan now (`num_tokens` must be what was reserved)."""
        req = self.reserved.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} has no reservation")
        if req.num_tokens != num_tokens:
            raise ValueError(f"request {request_id!r} reserved {req.num_tokens} tokens, not {num_tokens}")
        del self.reserved[request_id]
        return req

    def cancel(self, request_id: str) -> bool:
        return self.reserved.pop(request_id, None) is not None

    def mark_dead(self, member: int) -> list[str]:
        """`member` died (its requests already left the plan): place the reservations that used it again;
        returns those that no longer fit (the caller fails them)."""
        self.dead.add(member)
        failed = []
        for rid, req in list(self.reserved.items()):
            if req.master == member or req.range_of(member) is not None:
                del self.reserved[rid]
                if not self.reserve(rid, req.num_tokens):
                    failed.append(rid)
        return failed

    # ---- growth ----

    def scale_ups(self) -> ScaleUps:
        """Which requests must move their tail before the next step (every request appends one token)."""
        bs = self.config.block_size
        free = {m: self.free_blocks(m) for m in self.plan.members}  # 0 for a dead member
        growing: dict[int, list[KVPRequest]] = {}  # tail member -> requests whose next token needs a block
        for q in self.plan.requests.values():
            n = q.ranges[-1].num_tokens
            if _blocks(n + 1, bs) > _blocks(n, bs):
                growing.setdefault(q.tail, []).append(q)
        out = ScaleUps()
        for m, reqs in growing.items():
            free[m] -= len(reqs)
        for m in sorted(growing):
            for q in reversed(growing[m]):  # the latest admitted moves first
                if free[m] >= 0:
                    break
                free[m] += 1
                candidates = [c for c in self.live_members if q.range_of(c) is None and free[c] >= 1]
                if not candidates:
                    out.stuck.append(q.request_id)
                    continue
                best = min(candidates, key=lambda c: (-free[c], c))
                free[best] -= 1
                out.moves.append((q.request_id, best))
        return out


def _cut(num_tokens: int, order: list[int], cap: dict[int, int]) -> list[tuple[int, int]] | None:
    """Consecutive (member, tokens) ranges over `order`, each at most `cap[member]` tokens; None if short."""
    left, out = num_tokens, []
    for m in order:
        if left == 0:
            break
        n = min(cap[m], left)
        if n > 0:
            out.append((m, n))
            left -= n
    return out if left == 0 else None
