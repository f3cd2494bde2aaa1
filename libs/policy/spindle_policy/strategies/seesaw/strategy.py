"""`seesaw`: dynamic re-sharding with a CPU KV tier and transition-minimising scheduling (seed 004, §4).

Each colocated (elastic) instance is a Seesaw group: N GPUs that run as one `PPa x TPb` configuration at a time
(`InstanceInfo.parallel`) and switch with a `Reshard`. Requests wait in one FIFO queue; each free group takes its
next iteration from it (per-iteration dispatch, `RunBatch`), by `schedule`:

- `transition` (Seesaw, §4.2): in the prefill configuration `c_p`, prefill iterations of waiting prompts whose KV
  goes to the kvstore's host tier as it is computed (`RunBatch.offload`), until the tier has no room for the next
  prompt or nothing waits; then re-shard to `c_d` and decode, onboarding prompts from the tier (`MigrateKV` from
  the kvstore: the prefetcher, overlapped with the decode iterations) whenever the group's KV has room for a whole
  sequence, until the tier is empty; then, if prompts wait, switch back. At that switch the requests still decoding
  go back to the tier (their KV re-shards through host memory, Fig. 7) and are onboarded first next time.
- `prefill-first` (vLLM's default without chunked prefill): a prefill iteration whenever waiting prompts fit the
  group's KV (whole sequences reserved), else a decode iteration.
- `decode-first`: prefill only when nothing decodes, then until the KV is full; decode until every request ends.
- `chunked` (vLLM's chunked prefill): every iteration decodes every running request and adds up to `chunk_size`
  prompt tokens, FCFS.

`prefill` / `decode` name `c_p` / `c_d` (default: the latency model's `ReshardModel` choice, `configs.choose`);
`static=LABEL` runs everything in one configuration (no re-shard: vLLM's static parallelism and the paper's
baselines). The other schedules re-shard too when `c_p` and `c_d` differ (Fig. 2's frequent transitions).

On the services (no `ReshardModel`: the scheduler has no cost model of the live group) the groups say what they
are: each registers its `reshard_plan` (`c_p:c_d`, the default here), its current configuration and its KV room
(one capacity in both configurations), and its own host KV tier as a kvstore `<group>-host`, which it uses instead
of a shared kvstore. The services run the `transition` schedule (a group prefills only in a pipeline
configuration, into its tier, and decodes only in a tensor-parallel one).

Choices the paper leaves open: a prefill iteration takes waiting prompts FCFS up to `max_prefill_tokens`; a
pipeline configuration (PP > 1) overlaps prefill micro-batches and splits decodes into PP micro-batches (§5.1:
"each decoding step processes 1/PP of the sequences"); a decode batch is at most `max_decodes`; a request's
whole sequence is reserved when it joins the group's KV (no preemption), as every Spindle strategy does.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from spindle_protocol.messages import (
    IterationDone,
    KVMigrated,
    PrefillDone,
    RequestFinished,
    RequestSpec,
    Resharded,
    TransferDone,
    WorkerEvent,
)

from ...actions import Action, Admit, DecodePart, KVShard, MigrateKV, PrefillPart, Reject, Reshard, RunBatch
from ...latency import LatencyModel
from ...reshard_model import ReshardModel, parse_label
from ...state import ClusterState
from ...strategy import Strategy, register_strategy

ROLE = "elastic"
SCHEDULES = ("transition", "prefill-first", "decode-first", "chunked")


@dataclass
class Group:
    id: str
    parallel: str  # the configuration it runs now (its wanted one while a Reshard is in flight)
    busy: bool = False  # an iteration, a switch or a drain in flight
    draining: bool = False  # its decodes going back to the tier before a switch to prefill
    phase: str = "prefill"
    running: dict[str, int] = field(default_factory=dict)  # decoding, KV on the group -> its decode micro-batch
    tier: deque[str] = field(default_factory=deque)  # its prompts' KV in the host tier, to onboard in order
    moving: set[str] = field(default_factory=set)  # onboarding or going back to the tier
    landed: set[str] = field(default_factory=set)  # in the tier, its swap-out done (TransferDone)
    prefilling: dict[str, int] = field(default_factory=dict)  # chunked: request -> prompt tokens done
    reserved: dict[str, int] = field(default_factory=dict)  # request -> KV tokens it holds or will hold here
    filling: bool = True  # decode-first: prefilling until the KV is full
    turn: int = 0  # the next decode micro-batch (PP > 1)
    kv_tokens: int = 0  # its KV room as registered (on the services; the simulator's comes from the ReshardModel)
    tier_id: str = ""  # the host tier its prompts go to: its own (`<id>-host`) or the kvstore groups share

    @property
    def used(self) -> int:
        return sum(self.reserved.values())

    def join(self, rid: str, pp: int) -> None:
        """`rid` decodes from now on, in the emptiest of `pp` micro-batches (it keeps its micro-batch: a request in
        two consecutive ones would wait for its own sample)."""
        counts = [0] * pp
        for slot in self.running.values():
            counts[slot % pp] += 1
        self.running[rid] = counts.index(min(counts))


@register_strategy("seesaw")
class SeesawStrategy(Strategy):
    tuning = {"decode_tp": (1, 2, 4), "chunk_size": (512, 2048)}  # noqa: RUF012
    elastic = True
    colocated = True
    takes_decode_options = False
    reshards = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        schedule: str = "transition",
        prefill: str = "",
        decode: str = "",
        static: str = "",
        max_prefill_tokens: int = 8192,
        max_decodes: int = 512,
        chunk_size: int = 512,
    ) -> None:
        super().__init__(latency)
        if schedule not in SCHEDULES:
            raise ValueError(f"seesaw: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if min(max_prefill_tokens, max_decodes, chunk_size) < 1:
            raise ValueError("seesaw: max_prefill_tokens, max_decodes and chunk_size must be >= 1")
        if static and (prefill or decode):
            raise ValueError("seesaw: give static, or prefill and decode, not both")
        # None on the services: the groups' registrations say what they are (the module docstring)
        self.model: ReshardModel | None = latency.reshard if latency is not None else None
        self.schedule, self.static = schedule, static
        self.c_p = static or prefill or (self.model.prefill if self.model else "")
        self.c_d = static or decode or (self.model.decode if self.model else "")
        for label in filter(None, (self.c_p, self.c_d)):
            if self.model is not None:
                self.model.config(label)  # a configuration the model has (a ValueError names those it has)
            else:
                parse_label(label)
        self.max_prefill_tokens, self.max_decodes, self.chunk_size = max_prefill_tokens, max_decodes, chunk_size
        self.groups: dict[str, Group] = {}
        self.waiting: deque[RequestSpec] = deque()
        self.specs: dict[str, RequestSpec] = {}
        self._forgotten_seen = 0  # of ClusterState.forgotten_total
        self.home: dict[str, str] = {}  # request -> its group
        self.in_flight: dict[int, str] = {}  # batch id -> group
        self.tiers: dict[str, tuple[int, int]] = {}  # host tier (a kvstore) -> its room in tokens, its block size
        self.tier_held: dict[str, int] = {}  # request -> KV tokens it holds (or will) in its group's tier
        self._tier_at: dict[str, tuple[str, int]] = {}  # request -> (the tier it is counted in, its blocks there)
        self._tier_blocks: dict[str, int] = {}  # tier -> blocks its requests hold
        self._ids = itertools.count(1)

    @classmethod
    def stack_gap(cls, options: dict[str, object]) -> str:
        if options.get("schedule", "transition") != "transition" or options.get("static"):
            return ("a group on the services prefills into its host tier in a pipeline configuration and decodes in "
                    "a tensor-parallel one: the transition schedule only, without static")  # fmt: skip
        return ""

    def options(self) -> dict[str, object]:
        return {"schedule": self.schedule, "prefill": self.c_p, "decode": self.c_d, "static": self.static,
                "max_prefill_tokens": self.max_prefill_tokens, "max_decodes": self.max_decodes,
                "chunk_size": self.chunk_size}  # fmt: skip

    def describe(self) -> str:
        opts = {"schedule": self.schedule} if self.schedule != "transition" else {}
        opts |= {"static": self.static} if self.static else {"prefill": self.c_p, "decode": self.c_d}
        named = ",".join(f"{k}={v}" for k, v in opts.items() if v)  # on the services c_p, c_d may come from the groups
        return f"{self.name}:{named}" if named else self.name

    # ---- bookkeeping ----

    def _kv_tokens(self, g: Group, label: str = "") -> int:
        """The group's KV room in configuration `label` (default: its own)."""
        return self.model.config(label or g.parallel).kv_tokens if self.model is not None else g.kv_tokens

    def _room(self, g: Group, label: str = "") -> int:
        """KV tokens the group has room for in configuration `label` (default: its own), less what its requests hold
        or will hold."""
        return self._kv_tokens(g, label) - g.used

    def _sync(self, state: ClusterState) -> None:
        stores = {s.id: s.info for s in state.live("kvstore")}
        tiers = {iid: (info.kv_blocks_total * (info.block_size or 1), info.block_size or 1)
                 for iid, info in stores.items()}  # fmt: skip
        recount = tiers != self.tiers
        self.tiers = tiers
        shared = min((iid for iid in stores if not iid.endswith("-host")), default="")  # a kvstore groups share
        for inst in state.live(ROLE):
            info = inst.info
            g = self.groups.get(inst.id)
            if g is None:
                if self.model is None and info.reshard_plan and not (self.c_p and self.c_d):
                    p, d = info.reshard_plan.split(":")
                    self.c_p, self.c_d = self.c_p or p, self.c_d or d
                g = self.groups[inst.id] = Group(inst.id, info.parallel or self.c_p)
            g.kv_tokens = info.kv_blocks_total * (info.block_size or 1)
            if g.tier_id not in stores:  # the first, or a new one after a loss
                own = f"{inst.id}-host"
                g.tier_id = own if own in stores else shared
                recount = True
        if recount:
            self._recount_tiers()
        ended = state.forgotten_since(self._forgotten_seen)
        self._forgotten_seen = state.forgotten_total
        if ended is None:  # more ended than the state keeps: check every request against it
            ended = [r for r in self.specs if r not in state.requests]
        for rid in ended:
            if rid in self.specs:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        spec = self.specs.pop(rid, None)
        placed = rid in self.home  # a request leaves `waiting` when it gets its group
        g = self.groups.get(self.home.pop(rid, ""))
        if spec is not None and not placed and spec in self.waiting:
            self.waiting.remove(spec)
        if g is None:
            return
        self._tier_pop(rid)
        if rid in g.tier:
            g.tier.remove(rid)
        g.running.pop(rid, None)
        g.prefilling.pop(rid, None)
        g.reserved.pop(rid, None)
        g.moving.discard(rid)
        g.landed.discard(rid)
        self._drained(g)

    def _drained(self, g: Group) -> None:
        """The decodes going back to the tier are all there (or gone): the switch to prefill can go."""
        if g.draining and not g.moving:
            g.draining = g.busy = False

    # ---- arrivals and events ----

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        rid = spec.request_id
        if not self.groups:
            return [Reject(rid, 503, "no live elastic (colocated) instance")]
        if spec.sampling.n > 1:
            return [Reject(rid, 400, "seesaw decodes one choice per request; send n = 1")]
        need = spec.prompt.num_tokens + spec.sampling.max_tokens
        room = max(min(self._kv_tokens(g, c) for c in {self.c_p, self.c_d}) for g in self.groups.values())
        if need > room:
            return [Reject(rid, 400, f"prompt plus max_tokens ({need} tokens) does not fit a group's KV ({room})")]
        tier = max(self.tiers.get(g.tier_id, (0, 1))[0] for g in self.groups.values())
        if self.schedule == "transition" and spec.prompt.num_tokens > tier:
            return [Reject(rid, 400, f"the prompt ({spec.prompt.num_tokens} tokens) does not fit the host KV tier "
                           f"({tier} tokens)")]  # fmt: skip
        self.specs[rid] = spec
        self.waiting.append(spec)
        return [Admit(rid, (), ""), *self._schedule()]

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        match event:
            case IterationDone(batch_id=bid):
                if (g := self.groups.get(self.in_flight.pop(bid, ""))) is not None:
                    g.busy = False
            case Resharded(instance_id=iid, config=label) if iid in self.groups:
                g = self.groups[iid]
                g.parallel, g.busy = label, False
            case KVMigrated(request_id=rid, dst=dst) if (g := self.groups.get(self.home.get(rid, ""))) is not None:
                g.moving.discard(rid)
                if dst == g.id:  # onboarded: its copy in the tier is gone now
                    self._tier_pop(rid)
                    g.join(rid, self._decode_pp)
                else:  # back in the tier for the next decode phase, first in line
                    g.reserved.pop(rid, None)
                    g.tier.appendleft(rid)
                    g.landed.add(rid)
                    self._drained(g)
            case TransferDone(request_id=rid, parked=True) if g := self.groups.get(self.home.get(rid, "")):
                g.reserved.pop(rid, None)  # its prompt's KV left the group for the tier
                g.landed.add(rid)
            case PrefillDone(request_id=rid, finished=False) if g := self.groups.get(self.home.get(rid, "")):
                if self.schedule != "transition":
                    g.prefilling.pop(rid, None)
                    g.join(rid, self._decode_pp)
            case PrefillDone(request_id=rid) | RequestFinished(request_id=rid):
                self._drop(rid)
        return self._schedule()

    def on_tick(self, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        return self._schedule()

    def on_instance_lost(self, instance_id: str, state: ClusterState, now: float) -> list[Action]:
        """The core failed the requests the group held; its queue position is gone with it."""
        g = self.groups.pop(instance_id, None)
        if g is not None:
            for rid in [*g.tier, *g.moving]:
                self._tier_pop(rid)
            for bid in [b for b, iid in self.in_flight.items() if iid == instance_id]:
                del self.in_flight[bid]
        return self._schedule()

    # ---- what each free group runs next ----

    def _schedule(self) -> list[Action]:
        actions: list[Action] = []
        for g in self.groups.values():
            if not g.busy:
                actions += self._next(g)
        return actions

    def _switch(self, g: Group, to: str) -> list[Action]:
        g.parallel, g.busy = to, True
        return [Reshard(g.id, to)]

    def _next(self, g: Group) -> list[Action]:
        if self.schedule == "transition":
            return self._transition(g)
        if self.schedule == "chunked":
            return self._chunked(g)
        prefill = self.schedule == "prefill-first" and self.waiting and self._fits(g, self.waiting[0], self.c_p)
        if self.schedule == "decode-first":
            g.filling = g.filling or not g.running
            prefill = g.filling and bool(self.waiting) and self._fits(g, self.waiting[0], self.c_p)
            g.filling = bool(prefill)
        if prefill:
            if g.parallel != self.c_p:
                return self._switch(g, self.c_p)
            return self._prefill(g, offload=False)
        if g.running:
            if g.parallel != self.c_d:
                return self._switch(g, self.c_d)
            return self._decode(g)
        return []

    def _fits(self, g: Group, spec: RequestSpec, label: str = "") -> bool:
        """The request's whole sequence fits the group's KV in configuration `label` (default: its own)."""
        return spec.prompt.num_tokens + spec.sampling.max_tokens <= self._room(g, label)

    def _transition(self, g: Group) -> list[Action]:
        if g.phase == "prefill":
            if g.parallel != self.c_p:
                return self._switch(g, self.c_p)
            if self.waiting and self._tier_fits(g, self.waiting[0]):
                if self._prefill_fits(g, self.waiting[0]):
                    return self._prefill(g, offload=True)
                if any(rid not in g.landed for rid in g.tier):
                    return []  # its room frees as the prompts in flight reach the tier (TransferDone)
            if not (g.tier or g.running):
                return []  # nothing to decode: wait for prompts (or room) here
            if self.c_p != self.c_d and any(rid not in g.landed for rid in g.tier):
                return []  # switch once the last prompts are in the tier (TransferDone): nothing to re-shard
            g.phase = "decode"
        if g.parallel != self.c_d:
            return self._switch(g, self.c_d)
        actions: list[Action] = []
        while g.tier and g.tier[0] in g.landed and self._fits(g, self.specs[g.tier[0]]):  # the prefetcher
            rid = g.tier.popleft()
            g.landed.discard(rid)
            spec = self.specs[rid]
            g.reserved[rid] = spec.prompt.num_tokens + spec.sampling.max_tokens
            g.moving.add(rid)
            actions.append(MigrateKV(rid, g.tier_id, g.id))
        back = tuple(g.reserved[rid] for rid in g.running) if self.c_p != self.c_d else ()
        # (one configuration: the decodes stay on the group, so the next prompt must fit beside them)
        room = self.c_p != self.c_d or (bool(self.waiting) and self._prefill_fits(g, self.waiting[0]))
        if not g.tier and not g.moving and self.waiting and room and self._tier_fits(g, self.waiting[0], back):
            g.phase = "prefill"  # the tier is drained: back to prefill; the decodes wait in the tier
            if g.running and self.c_p != self.c_d:
                for rid in g.running:
                    g.moving.add(rid)
                    self._tier_put(rid, g.reserved[rid])
                    actions.append(MigrateKV(rid, g.id, g.tier_id))
                g.running.clear()
                g.busy = g.draining = True  # until the last one is out (KVMigrated), then the switch
                return actions
            return actions + self._next(g)
        if g.running:
            actions += self._decode(g)
        return actions

    def _tier_fits(self, g: Group, spec: RequestSpec, more: tuple[int, ...] = ()) -> bool:
        """The group's tier has room for the prompt's KV (and the KV of decodes going back, `more` tokens each),
        counted in its blocks as the kvstore holds them (each request's rounded up)."""
        tokens, block = self.tiers.get(g.tier_id, (0, 1))
        blocks = lambda n: -(-n // block)  # noqa: E731
        held = self._tier_blocks.get(g.tier_id, 0) + sum(blocks(n) for n in more)
        return (held + blocks(spec.prompt.num_tokens)) * block <= tokens

    def _tier_put(self, rid: str, tokens: int) -> None:
        """`rid` holds (or will hold) `tokens` KV tokens in its group's tier; each tier's blocks are counted as
        they change (`_tier_blocks`), so a fit costs the same however many requests the tiers hold."""
        self._tier_pop(rid)
        tier = self._tier_of(rid)
        blocks = -(-tokens // self.tiers.get(tier, (0, 1))[1])
        self.tier_held[rid] = tokens
        self._tier_at[rid] = (tier, blocks)
        self._tier_blocks[tier] = self._tier_blocks.get(tier, 0) + blocks

    def _tier_pop(self, rid: str) -> None:
        self.tier_held.pop(rid, None)
        if (at := self._tier_at.pop(rid, None)) is not None:
            self._tier_blocks[at[0]] -= at[1]

    def _recount_tiers(self) -> None:
        """Every request's tier blocks again (a group got another tier, or a tier's block size changed)."""
        held, self._tier_at, self._tier_blocks = dict(self.tier_held), {}, {}
        for rid, tokens in held.items():
            self._tier_put(rid, tokens)

    def _tier_of(self, rid: str) -> str:
        g = self.groups.get(self.home.get(rid, ""))
        return g.tier_id if g is not None else ""

    def _prefill_fits(self, g: Group, spec: RequestSpec) -> bool:
        """An offloaded prompt holds the group's KV only while it is computed and swapped out."""
        return spec.prompt.num_tokens <= self._room(g)

    def _prefill(self, g: Group, offload: bool) -> list[Action]:
        parts, tokens = [], 0
        while self.waiting and len(parts) < self.max_decodes:
            spec = self.waiting[0]
            n = spec.prompt.num_tokens
            if parts and tokens + n > self.max_prefill_tokens:
                break
            if offload and not (self._tier_fits(g, spec) and self._prefill_fits(g, spec)):
                break
            if not offload and not self._fits(g, spec):
                break
            self.waiting.popleft()
            rid = spec.request_id
            self.home[rid] = g.id
            tokens += n
            if offload:
                self._tier_put(rid, n)
                g.reserved[rid] = n  # on the group until it is swapped out
                g.tier.append(rid)
                parts.append(PrefillPart(spec, 0, n, (KVShard(g.tier_id, 0, n),)))
            else:
                g.reserved[rid] = n + spec.sampling.max_tokens
                parts.append(PrefillPart(spec, 0, n, (KVShard(g.id, 0, n),)))
        if not parts:
            return []
        return [self._batch(g, RunBatch(next(self._ids), (g.id,), tuple(parts), offload=g.tier_id if offload else "",
                                        overlap=parse_label(g.parallel)[1] > 1))]  # fmt: skip

    @property
    def _decode_pp(self) -> int:
        return parse_label(self.c_d)[1]

    def _decode(self, g: Group) -> list[Action]:
        """The next non-empty decode micro-batch (all of them when the configuration has one stage)."""
        pp = parse_label(g.parallel)[1]
        batch: list[str] = []
        for _ in range(pp):
            batch = [rid for rid, slot in g.running.items() if pp == 1 or slot % pp == g.turn % pp]
            g.turn += 1
            if batch:
                break
        if not batch:
            return []
        parts = tuple(DecodePart(rid, g.id) for rid in batch[: self.max_decodes])
        return [self._batch(g, RunBatch(next(self._ids), (g.id,), decodes=parts, overlap=pp > 1))]

    def _chunked(self, g: Group) -> list[Action]:
        if g.parallel != self.c_d:
            return self._switch(g, self.c_d)
        budget, parts = self.chunk_size, []
        for rid, done in list(g.prefilling.items()):  # continue the prompts under way first
            spec = self.specs[rid]
            n = min(budget, spec.prompt.num_tokens - done)
            if n > 0:
                parts.append(PrefillPart(spec, done, done + n, (KVShard(g.id, done, done + n),)))
                g.prefilling[rid], budget = done + n, budget - n
        while budget > 0 and self.waiting and self._fits(g, self.waiting[0]):
            spec = self.waiting.popleft()
            rid, n = spec.request_id, min(budget, spec.prompt.num_tokens)
            self.home[rid] = g.id
            g.reserved[rid] = spec.prompt.num_tokens + spec.sampling.max_tokens
            g.prefilling[rid], budget = n, budget - n
            parts.append(PrefillPart(spec, 0, n, (KVShard(g.id, 0, n),)))
        decodes = tuple(DecodePart(rid, g.id) for rid in list(g.running)[: self.max_decodes])
        if not parts and not decodes:
            return []
        return [self._batch(g, RunBatch(next(self._ids), (g.id,), tuple(parts), decodes))]

    def _batch(self, g: Group, batch: RunBatch) -> RunBatch:
        g.busy = True
        self.in_flight[batch.batch_id] = g.id
        return batch
