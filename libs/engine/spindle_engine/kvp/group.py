"""Where a KVP decode group puts each request (pure): Medha-style placement, multi-master, scale-up and -down.

The group's leader owns one `GroupPlanner` over the shared `KVPPlan` (the one its `KVPMember` steps with).
Every member allocates a range `[start, end)` from its local slot 0, so the blocks each member uses follow
from the plan alone: `ceil(tokens / block_size)` per range, plus what reservations hold. That lets the
leader place requests and decide scale-ups for every member without asking, and check the followers'
reported block counts against it.

- `place_given(rid, n, shards)`: the scheduler's placement (`PlaceKVP`, members by the scheduler core's own
  Medha rule over the members' registry entries), used by `reserve` when it fits now; `member_loads()` is
  what each member's registry entry reports.
- `reserve(rid, n)`: a request whose prompt exceeds `kvp_tokens` (the per-member KV token limit; 0 = no
  limit, one member when one has room) is split into consecutive ranges of at most that many tokens over
  `ceil(n / kvp_tokens)` members, those with the most free blocks first; ranges need not fall on block
  boundaries. When the limit would need more members than the group has, or they lack room, ranges are cut
  by free space instead. The last range (the tail, which takes new tokens) goes to the member left with the
  most free blocks, and there must be room for the first decoded token.
- The master is the member mastering the fewest requests (ties: the tail, then other holders, then the
  lowest member), so different members run different requests' layers.
- `scale_ups()` before each step: a tail member whose requests' next tokens need more blocks than it has
  free hands the tails of some of them to a member that holds no range of that request yet (LoongServe's
  scale-up: existing KV never moves): the one with the most free blocks among those that keep every request's
  committed growth within reach (`growth_fits`' flow), so a move never takes the room another request depends
  on. A request no member can take is `stuck`.
- `scale_downs()` before each step, before `scale_ups()` (`scale_down_tokens` > 0 turns it on): a *fragment*,
  a range shorter than `scale_down_tokens` held by a member that is not the request's master, merges into the
  holder before it (or after it, when it is the first range), the one KV move of the group (plan.py), when that
  holder has room for it and then still has room for all the growth committed to the tails it holds (this
  request's too, when the fragment was the tail). Fragments come from scale-ups (a tail that had to move because
  its member filled up with other requests, which later finished) and from placements cut by free space; each
  costs its holder a query and a partial state per layer and step, and its master one more merge, for little
  KV. The room rule means a merged tail never has to scale up again for committed growth, so ranges do not
  ping-pong. At most one scale-down per request per step. `scale_down_fits` checks an explicit one (a scheduler
  strategy's `KVPLeaderEngine.request_scale_down`): room for the range alone.
- Growth is committed: each placed request's KV may still grow to `final_tokens` (its max_tokens, set by
  `commit` when it joins, or at `reserve` when the service passes it), and a new reservation must leave the
  group enough free blocks for that growth of every placed and reserved request, so admitting one request does
  not leave the ones decoding without room (there is no preemption inside a group: a stuck request fails).
  Counting blocks group-wide is not enough: a request's new tokens reach only its tail and the members holding
  none of it, so `growth_fits` solves the small transport problem (growth.py) and a reservation that would
  leave some request without reachable room is refused too (unless that request could not grow even alone in
  an empty group: then only the count applies). A refused reservation waits (the service parks it).
- `mark_dead(m)`: a member that died leaves the group for good: nothing is placed there again, the group's
  blocks shrink by its share, and reservations that used it are placed again on the others (or fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from .growth import demands_fit
from .plan import KVPPlan, KVPRequest, KVRange


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class GroupConfig:
    num_members: int
    blocks_per_member: int
    block_size: int = 16
    kvp_tokens: int = 0  # per-member KV token limit of a new request's ranges; 0 = none
    scale_down_tokens: int = 0  # non-master ranges shorter than this merge into a neighbour with room; 0 = never

    def __post_init__(self) -> None:
        if self.num_members < 1 or self.blocks_per_member < 1 or self.block_size < 1:
            raise ValueError(f"a KVP group needs members, blocks and a block size >= 1, got {self}")
        if self.kvp_tokens < 0:
            raise ValueError(f"kvp_tokens must be >= 0, got {self.kvp_tokens}")
        if self.scale_down_tokens < 0:
            raise ValueError(f"scale_down_tokens must be >= 0, got {self.scale_down_tokens}")

    @property
    def num_blocks(self) -> int:
        return self.num_members * self.blocks_per_member


@dataclass
class MemberLoad:
    total: int  # blocks
    used: int = 0
    mastering: int = 0  # requests it leads (samples)
    requests: dict[str, int] = field(default_factory=dict)  # request id -> blocks it holds here


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
        self.scale_down_count = 0
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
        """Blocks the placed requests may still take as they decode."""
        return sum(self._growth(q) for q in self.plan.requests.values())

    def _growth(self, q: KVPRequest) -> int:
        """Blocks `q` may still take as it decodes (one more for a scale-up's new range)."""
        left, bs = self._left(q), self.config.block_size
        if left <= 0:
            return 0
        n = q.ranges[-1].num_tokens
        return _blocks(n + left, bs) - _blocks(n, bs) + 1

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

    def place_given(self, request_id: str, num_tokens: int, shards: list[tuple[int, int, int]]) -> KVPRequest | None:
        """The scheduler's placement (`PlaceKVP`): `shards` (member, start, end) tile `[0, num_tokens)` in order,
        the first on the master. None when it does not fit now (a member without room for its range, or none
        for the first decoded token); ValueError when it names dead or unknown members or does not tile."""
        if not shards or shards[-1][2] != num_tokens:
            raise ValueError(f"shards {shards} do not cover {num_tokens} tokens")
        members = [m for m, _, _ in shards]
        if any(m not in self.plan.members or m in self.dead for m in members):
            raise ValueError(f"shards {shards} name a member that is not live ({list(self.live_members)})")
        if any(end <= start for _, start, end in shards):
            raise ValueError(f"shards {shards} have an empty range")
        if shards[0][1] != 0 or any(a[2] != b[1] for a, b in pairwise(shards)):
            raise ValueError(f"shards {shards} must tile the tokens from 0")
        req = KVPRequest.split(request_id, members[0], members, [shards[0][1], *(end for _, _, end in shards)])
        if any(self.free_blocks(r.member) < self._range_blocks(r) for r in req.ranges):
            return None
        if not self._next_token_fits([(r.member, r.num_tokens) for r in req.ranges]):
            return None
        return req

    def reserve(self, request_id: str, num_tokens: int, req: KVPRequest | None = None, final_tokens: int = 0) -> bool:
        """Hold blocks for `request_id`: at `req` (from `place_given`) or where `place` puts it. False when it
        does not fit, or would leave too little room for the committed growth of the placed and reserved
        requests (this one's too: up to `final_tokens` KV tokens, when given), each on the members its new
        tokens can reach (`growth_fits`)."""
        if request_id in self.reserved or request_id in self.plan.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = req or self.place(request_id, num_tokens)
        if req is None:
            return False
        free = self.num_blocks - self.num_used - sum(self._range_blocks(r) for r in req.ranges)
        if free < self.growth_blocks():
            return False
        fitted = self.growth_fits()  # False only after a request that could never fit alone (below)
        if final_tokens > num_tokens:
            self.final_tokens[request_id] = final_tokens
        self.reserved[request_id] = req
        if fitted and not self.growth_fits() and self.growth_fits(only=req):
            del self.reserved[request_id]  # it would leave another request (or itself) stuck: it waits
            self.final_tokens.pop(request_id, None)
            return False
        return True

    def growth_fits(self, only: KVPRequest | None = None) -> bool:
        """Whether every placed and reserved request (or `only` that one, in an otherwise empty group) can grow
        to its committed size on its tail and the members holding none of it (growth.py)."""
        if only is None:
            requests = [*self.plan.requests.values(), *self.reserved.values()]
            free = {m: self.free_blocks(m) for m in self.live_members}
        else:
            requests = [only]
            free = {m: self.config.blocks_per_member for m in self.live_members}
            for r in only.ranges:
                free[r.member] = free.get(r.member, 0) - self._range_blocks(r)
        demands = [
            (blocks, [m for m in free if m == q.tail or q.range_of(m) is None])
            for q in requests
            if (blocks := self._growth(q))
        ]
        return demands_fit(demands, free)

    def member_loads(self) -> dict[int, MemberLoad]:
        """What each live member holds and leads, for its registry entry (placed and reserved requests)."""
        loads = {m: MemberLoad(self.config.blocks_per_member) for m in self.live_members}
        for q in (*self.plan.requests.values(), *self.reserved.values()):
            if q.master in loads:
                loads[q.master].mastering += 1
            for r in q.ranges:
                if r.member in loads and (blocks := self._range_blocks(r)):
                    loads[r.member].requests[q.request_id] = blocks
                    loads[r.member].used += blocks
        return loads

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
        self.final_tokens.pop(request_id, None)
        return self.reserved.pop(request_id, None) is not None

    def mark_dead(self, member: int) -> list[str]:
        """`member` died (its requests already left the plan): place the reservations that used it again;
        returns those that no longer fit (the caller fails them)."""
        self.dead.add(member)
        failed = []
        for rid, req in list(self.reserved.items()):
            if req.master == member or req.range_of(member) is not None:
                del self.reserved[rid]
                if not self.reserve(rid, req.num_tokens, final_tokens=self.final_tokens.get(rid, 0)):
                    self.final_tokens.pop(rid, None)
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
                candidates.sort(key=lambda c: (-free[c], c))
                tails = dict(out.moves)
                best = next(
                    (c for c in candidates if self._growth_fits_after(growing, {**tails, q.request_id: c}, free, c)),
                    candidates[0],  # no choice keeps every request's growth in reach: the freest, as before
                )
                free[best] -= 1
                out.moves.append((q.request_id, best))
        return out

    def _growth_fits_after(
        self, growing: dict[int, list[KVPRequest]], tails: dict[str, int], free: dict[int, int], taken: int
    ) -> bool:
        """Whether every placed and reserved request's committed growth still fits (growth.py) once this step's
        tokens are placed, the tails in `tails` moved, and one more block of `taken` used by the latest move.
        `free` has this step's blocks already taken from the tails (blocks of moves still to decide stay counted
        on their old tail, which only makes the check less strict)."""
        supply = {m: free[m] - (m == taken) for m in self.live_members}
        now = {q.request_id for reqs in growing.values() for q in reqs}  # their next block is taken already
        demands = []
        for q in (*self.plan.requests.values(), *self.reserved.values()):
            tail = tails.get(q.request_id, q.tail)
            blocks = self._growth(q) - (q.request_id in now)
            if blocks > 0:
                demands.append((blocks, [m for m in supply if m == tail or q.range_of(m) is None]))
        return demands_fit(demands, supply)

    # ---- consolidation ----

    def _left(self, q: KVPRequest) -> int:
        """Tokens `q` may still append (its committed growth)."""
        return max(0, self.final_tokens.get(q.request_id, q.num_tokens) - q.num_tokens)

    def _merge_blocks(self, q: KVPRequest, member: int, into: int) -> int:
        """Blocks `into` gains when `member`'s range of `q` merges into its own."""
        gone, kept = q.range_of(member), q.range_of(into)
        assert gone is not None and kept is not None
        bs = self.config.block_size
        return _blocks(kept.num_tokens + gone.num_tokens, bs) - _blocks(kept.num_tokens, bs)

    def scale_down_fits(self, request_id: str, member: int, into: int | None = None) -> bool:
        """Whether `member` may leave `request_id` now (room on the receiver for its range). ValueError when the
        plan does not allow it (plan.py)."""
        q = self.plan.get(request_id)
        target = q.scale_down_target(member, into)
        return target not in self.dead and self.free_blocks(target) >= self._merge_blocks(q, member, target)

    def scale_downs(self) -> list[tuple[str, int, int]]:
        """Fragments to merge before the next step: (request, leaving member, receiver), in plan order."""
        limit, bs = self.config.scale_down_tokens, self.config.block_size
        if not limit:
            return []
        free = {m: self.free_blocks(m) for m in self.plan.members}
        growth = dict.fromkeys(self.plan.members, 0)  # blocks the tails on each member may still take
        for q in self.plan.requests.values():
            n = q.ranges[-1].num_tokens
            growth[q.tail] += _blocks(n + self._left(q), bs) - _blocks(n, bs)
        out = []
        for q in self.plan.requests.values():
            for i, r in enumerate(q.ranges):
                if len(q.ranges) < 2 or r.member == q.master or r.num_tokens >= limit:
                    continue
                into = self._fragment_target(q, i, free, growth)
                if into is not None:
                    out.append((q.request_id, r.member, into))
                    break
        return out

    def _fragment_target(self, q: KVPRequest, i: int, free: dict[int, int], growth: dict[int, int]) -> int | None:
        """The neighbour (before, then after) that can take range `i` of `q` and keep room for its tails' growth;
        updates `free` and `growth` for the move."""
        bs, r = self.config.block_size, q.ranges[i]
        for j in (i - 1, i + 1):
            if not 0 <= j < len(q.ranges) or q.ranges[j].member in self.dead:
                continue
            into = q.ranges[j].member
            extra = self._merge_blocks(q, r.member, into)
            need = growth[into]
            if r.member == q.tail:  # the receiver becomes the tail: it takes q's growth from the merged range on
                merged = q.ranges[j].num_tokens + r.num_tokens
                need += _blocks(merged + self._left(q), bs) - _blocks(merged, bs)
            if free[into] - extra < need:
                continue
            free[into] -= extra
            free[r.member] += _blocks(r.num_tokens, bs)
            if r.member == q.tail:
                growth[r.member] -= _blocks(r.num_tokens + self._left(q), bs) - _blocks(r.num_tokens, bs)
                growth[into] = need
            return into
        return None


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
