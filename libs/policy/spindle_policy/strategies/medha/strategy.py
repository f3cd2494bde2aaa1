"""`medha`: Medha's replica scheduler (§4) over colocated instances, one iteration at a time.

Each elastic (colocated) instance is a replica that prefills and decodes in one engine. Every iteration, per replica:

1. Decodes: every request decoding there gets its next token; decodes are never preempted (§4.2).
2. Prefills: the replica's queue ordered by `policy` (slack.py: ILRS by relative slack, Eq. 7, recomputed every
   iteration, so a long prompt yields to more urgent ones between chunks: fine-grained preemption), then packed
   (packing.py) to the target iteration time with adaptive chunk sizes and prefill-prefill batching.
3. Predictions come from the mixed-batch step (`MixedBatchModel`: the cost model's on a named cluster, built from
   Eq. 1 and the decode step of a `spindle profile` on the real stack).

KVP load balancer (§4.3, kvp.py): a new request goes to the replica with room for its whole future KV (prompt +
max_tokens, reserved so no admission can force an eviction) and the least predicted pending prefill work, then the
most free KV; with no room anywhere it waits, first in first out, until KV frees, while later requests that fit may
pass it within a bounded share of the KV (`backfill`, 1/8 of a replica's; 0: strict first in first out). A request
no one replica can hold (or that would hold more than `kvp_tokens` on one) spans replicas (KV parallelism, §3.4):
its first chunks fill one replica's share, the next go to the next replica, whose iterations attend the earlier KV
where it stays (a `PrefillPart` with a `master`), and the last replica masters its decodes, every holder attending
its queries over its share. While a request spans replicas, they run their iterations together, as one group (each
member packs its own chunks and decodes, to the target time, as alone), so the request's KV is always in one
iteration.

Choices the paper leaves open (options):
- Deadlines (`ttft_min_s`, `ttft_factor`): the TTFT deadline of a request is ttft_min_s + ttft_factor x its prompt's
  prefill time alone on a replica; the evaluation's values are not stated (§2's example is 30 s for 1M tokens on a
  DGX-H100, about 2x the prefill time there). Defaults 0.25 s and 3x: every deadline is mostly proportional to the
  work, so a waiting short request's relative slack falls fast and it overtakes a long prompt within a few
  iterations (a large fixed part would make every short request look relaxed beside a long one).
- The target iteration time (`tpot_slo`): 0 derives it as 4x the replica's decode step of one request over 4,096
  tokens (TP8 Llama-3-8B on A100: ~18 ms; SmolLM2 on this CPU: ~80 ms).
- `min_chunk` (64: Fig. 5b's 32-64 tokens add little), `max_chunk` (8192), `max_share` (0.5: prefill-prefill
  batching's cap; 0 turns it off), `max_prefills` (8 chunks per iteration).
- Baselines of Fig. 22 as `policy`: `lrs` (relative slack, no prefill-prefill batching), `edf`, `fcfs` (Medha-FCFS
  of §5.2); those three run without prefill-prefill batching.

A replica may be a sequence pipeline (`spindle up --spp N`, `spindle sim --spp N`: Medha's SPP); the strategy plans
it like any replica: the pipelining is the instance's (an iteration that samples nothing is done when stage 0 is).
With `spp_overlap=1` it also keeps every request an iteration samples out of the next S - 1 iterations of an
S-stage replica (decodes in S micro-batches), so that iteration need not be waited for either (`RunBatch.overlap`):
a schedule for a pipeline engine that samples asynchronously, which the simulator models and Spindle's engine does
not have (the services refuse the option).
Options of KV parallelism: `kvp` (the most replicas one request spans; 0: as many as it needs, 1: never spans, so a
request larger than a replica is refused) and `kvp_tokens` (the most KV tokens of one request on one replica; 0:
its room). n > 1 choices are refused (400).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from spindle_protocol.messages import IterationDone, RequestFailed, RequestFinished, RequestSpec, WorkerEvent

from ...actions import Action, Admit, DecodePart, KVShard, PrefillPart, Reject, RunBatch
from ...latency import LatencyModel
from ...mixed_batch import MixedBatchModel
from ...state import ClusterState, InstanceState
from ...strategy import Strategy, register_strategy
from .kvp import Room, Span, fits_ever, place
from .packing import PackLimits, pack
from .slack import POLICIES, Prefilling, priority, relative_slack

ROLE = "elastic"
BACKFILL_SCAN = 64  # waiting requests past a blocked one that one placement pass looks at
ALONE_CACHE = 1 << 16  # prefill-alone predictions kept (cleared when full)


@dataclass
class Replica:
    id: str
    rank: int
    tp: int
    capacity: int  # KV tokens
    block: int  # tokens per KV block: a reservation takes whole blocks
    reserved: dict[str, int] = field(default_factory=dict)  # request -> KV tokens it may grow to, in whole blocks
    queue: list[Prefilling] = field(default_factory=list)  # prompts not done, in arrival order
    decoding: dict[str, int] = field(default_factory=dict)  # request -> KV tokens it holds
    running: int | None = None  # batch id of the iteration in flight
    spp: int = 1  # sequence-pipeline stages
    iterations: int = 0  # iterations sent
    sampled_at: dict[str, int] = field(default_factory=dict)  # request -> the iteration that last sampled it
    reserved_total: int = 0  # sum of `reserved`
    bypass_used: int = 0  # of `reserved`, what requests placed past a waiting one hold (`MedhaStrategy._place`)
    pending_s: float | None = None  # predicted prefill work of `queue` alone; None: to compute again

    def free(self) -> int:
        return self.capacity - self.reserved_total

    def reserve(self, rid: str, tokens: int, bypass: bool) -> None:
        self.reserved[rid] = tokens
        self.reserved_total += tokens
        self.bypass_used += tokens if bypass else 0

    def release(self, rid: str, bypass: bool) -> None:
        tokens = self.reserved.pop(rid, 0)
        self.reserved_total -= tokens
        self.bypass_used -= tokens if bypass else 0


def _ready(group: list[Replica]) -> bool:
    """No member is running an iteration and some member has work (one loop: this runs on every event)."""
    work = False
    for r in group:
        if r.running is not None:
            return False
        work = work or bool(r.queue or r.decoding)
    return work


@dataclass
class InFlight:
    replicas: tuple[str, ...]
    prefills: list[tuple[str, int, str]]  # (request, tokens, replica) of its chunks
    decodes: list[tuple[str, str]]  # (request, master)


@register_strategy("medha")
class MedhaStrategy(Strategy):
    tuning = {"decode_tp": (1, 2, 4), "max_chunk": (2048, 8192), "max_prefills": (4, 8)}  # noqa: RUF012
    takes_decode_options = False
    colocated = True
    keeps_kv_in_place = True
    elastic = True
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        policy: str = "ilrs",
        tpot_slo: float = 0.0,
        ttft_min_s: float = 0.25,
        ttft_factor: float = 3.0,
        min_chunk: int = 64,
        max_chunk: int = 8192,
        max_share: float = 0.5,
        max_prefills: int = 8,
        spp_overlap: int = 0,
        kvp: int = 0,
        kvp_tokens: int = 0,
        backfill: float = 0.125,
    ) -> None:
        super().__init__(latency)
        if policy not in POLICIES:
            raise ValueError(f"medha: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if tpot_slo < 0 or ttft_min_s < 0 or ttft_factor < 0:
            raise ValueError("medha: tpot_slo, ttft_min_s and ttft_factor must be >= 0")
        if ttft_min_s == 0 and ttft_factor == 0:
            raise ValueError("medha: ttft_min_s and ttft_factor cannot both be 0 (every deadline would be now)")
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"medha: need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
        if not 0 <= max_share < 1 or max_prefills < 1:
            raise ValueError("medha: max_share must be in [0, 1) and max_prefills >= 1")
        if spp_overlap not in (0, 1):
            raise ValueError(f"medha: spp_overlap must be 0 or 1, got {spp_overlap!r}")
        if kvp < 0 or kvp_tokens < 0:
            raise ValueError(f"medha: kvp and kvp_tokens must be >= 0, got {kvp}, {kvp_tokens}")
        if not 0 <= backfill < 1:
            raise ValueError(f"medha: backfill must be in [0, 1), got {backfill}")
        self.kvp, self.kvp_tokens, self.backfill = kvp, kvp_tokens, backfill
        self.bypassers: set[str] = set()  # placed past a request waiting for KV (`_place`)
        self.spp_overlap = bool(spp_overlap)
        self.policy, self.tpot_slo, self.ttft_min_s, self.ttft_factor = policy, tpot_slo, ttft_min_s, ttft_factor
        self.min_chunk, self.max_chunk, self.max_prefills = min_chunk, max_chunk, max_prefills
        self.max_share = max_share if policy == "ilrs" else 0.0
        self._share_given = max_share
        self.replicas: dict[str, Replica] = {}
        self.waiting: deque[Prefilling] = deque()  # admitted, no replica with room yet
        self.spans: dict[str, list[Span]] = {}  # request -> the replicas holding its KV, when more than one
        self.in_flight: dict[int, InFlight] = {}
        self._held: set[str] = set()  # every request admitted and not yet seen forgotten by the core
        self._span_prefill: dict[str, Prefilling] = {}  # a request spanning replicas, while it still prefills
        self._waiting_ids: set[str] = set()  # the requests in `waiting`
        # what a placement pass depends on changes only with these: a pass that placed nothing is not repeated
        # until one of them moved (`_place`)
        self._placement_version = 0  # bumped when `waiting`, the replicas or their reservations change
        self._placement_seen: tuple[int, tuple[str, ...] | None] | None = None
        self._groups_cache: list[list[Replica]] | None = None  # `_groups`, until a span or a replica changes
        self._alone_cache: dict[tuple[int, int, int], float] = {}  # `alone_s` of the current model
        self._live_seen: list[InstanceState] | None = None  # the state's live list `_sync` last read
        self._forgotten_seen = 0  # of ClusterState.forgotten_total
        self._model: MixedBatchModel | None = None
        self._ids = itertools.count(1)

    @classmethod
    def spreads_kv(cls, options: dict[str, object]) -> bool:
        return options.get("kvp", 0) != 1

    @classmethod
    def stack_gap(cls, options: dict[str, object]) -> str:
        if options.get("spp_overlap"):
            return "spp_overlap=1 needs a pipeline engine that samples asynchronously (Spindle's waits for each step)"
        return cls.real_stack_gap

    def options(self) -> dict[str, object]:
        return {
            "policy": self.policy, "tpot_slo": self.tpot_slo, "ttft_min_s": self.ttft_min_s,
            "ttft_factor": self.ttft_factor, "min_chunk": self.min_chunk, "max_chunk": self.max_chunk,
            "max_share": self._share_given, "max_prefills": self.max_prefills, "spp_overlap": int(self.spp_overlap),
            "kvp": self.kvp, "kvp_tokens": self.kvp_tokens, "backfill": self.backfill,
        }  # fmt: skip

    def describe(self) -> str:
        defaults = {"policy": "ilrs", "ttft_min_s": 0.25, "ttft_factor": 3.0, "min_chunk": 64, "max_chunk": 8192,
                    "max_share": 0.5, "max_prefills": 8, "tpot_slo": 0.0, "spp_overlap": 0, "kvp": 0,
                    "kvp_tokens": 0, "backfill": 0.125}  # fmt: skip
        opts = {k: v for k, v in self.options().items() if defaults.get(k) != v}
        return f"{self.name}:{','.join(f'{k}={v}' for k, v in opts.items())}" if opts else self.name

    # ---- predictions ----

    def model(self) -> MixedBatchModel:
        if self._model is None:
            assert self.latency is not None
            self._model = self.latency.mixed_model({r.tp for r in self.replicas.values()} or {1})
        return self._model

    def target_s(self, tp: int) -> float:
        """The iteration time a replica packs to: `tpot_slo`, or 4x its decode step (1 request, 4,096 tokens)."""
        return self.tpot_slo or 4.0 * self.model().predict(tp, (), 1, 4096)

    def alone_s(self, tp: int, history: int, tokens: int) -> float:
        """Prefill time of `tokens` prompt tokens after `history`, alone on a replica, in max_chunk pieces."""
        if tokens <= 0:
            return 0.0
        key = (tp, history, tokens)  # asked again for every queued request each iteration until it progresses
        if (seconds := self._alone_cache.get(key)) is None:
            if len(self._alone_cache) >= ALONE_CACHE:
                self._alone_cache.clear()
            seconds = self._alone_cache[key] = self._alone(tp, history, tokens)
        return seconds

    def _alone(self, tp: int, history: int, tokens: int) -> float:
        f = self.model().fit_for(tp)
        m = self.max_chunk
        k, r = divmod(tokens, m)  # k whole pieces after history, history + m, ..., then r tokens
        pairs = m * (k * history + m * k * (k - 1) / 2) + (history + k * m) * r
        dense = k * f.dense_s(m) + (f.dense_s(r) if r else 0.0)
        return dense + f.c_hist * pairs + f.c_sq * (k * m * m + r * r)

    # ---- the replicas as heartbeats show them ----

    def _sync(self, state: ClusterState) -> None:
        live = state.live(ROLE)
        for inst in () if live is self._live_seen else live:  # the state's list is new whenever an instance changed
            if inst.id not in self.replicas:
                info = inst.info
                block = info.block_size or 1
                self.replicas[inst.id] = Replica(inst.id, info.rank, info.tp_size, info.kv_blocks_total * block, block,
                                                 spp=info.spp_size)  # fmt: skip
                self._model = None  # a new TP degree may need its fit
                self._alone_cache.clear()
                self._groups_cache = None
                self._placement_version += 1
                for r in self.replicas.values():
                    r.pending_s = None
        self._live_seen = live
        ended = state.forgotten_since(self._forgotten_seen)
        self._forgotten_seen = state.forgotten_total
        if ended is None:  # more ended than the state keeps: check every request against it
            ended = [rid for rid in self._held if rid not in state.requests]
        gone = [rid for rid in ended if rid in self._held]
        for rid in gone:
            self._held.discard(rid)
            self._drop(rid)
        if any(rid in self._waiting_ids for rid in gone):
            self.waiting = deque(p for p in self.waiting if p.rid in state.requests)
            self._waiting_ids = {p.rid for p in self.waiting}

    def _drop(self, rid: str) -> None:
        self._placement_version += 1  # its reservations are free again
        if self.spans.pop(rid, None) is not None:
            self._groups_cache = None
        self._span_prefill.pop(rid, None)
        bypass = rid in self.bypassers
        self.bypassers.discard(rid)
        for r in self.replicas.values():
            queued = rid in r.reserved  # a replica queues only the requests that reserved KV on it
            r.release(rid, bypass)
            r.decoding.pop(rid, None)
            r.sampled_at.pop(rid, None)
            if queued and any(p.rid == rid for p in r.queue):
                r.queue = [p for p in r.queue if p.rid != rid]
                r.pending_s = None

    # ---- the strategy interface ----

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        rid = spec.request_id
        live = [r for r in self.replicas.values() if r.id not in state.dead]
        if not live:
            return [Reject(rid, 503, "no live elastic instance")]
        if spec.sampling.n > 1:
            return [Reject(rid, 400, "medha decodes one choice per request; send n = 1")]
        prompt, max_tokens = spec.prompt.num_tokens, spec.sampling.max_tokens
        empty = [Room(r.id, r.capacity, r.block, 0.0) for r in live]
        if not fits_ever(empty, prompt, max_tokens, self.kvp, self.kvp_tokens):
            where = "one replica's" if self.kvp == 1 else f"the KV of {self.kvp or len(live)} replica(s)"
            return [Reject(rid, 400, f"prompt plus max_tokens ({prompt + max_tokens} tokens) does not fit {where} "
                           f"(at most {max(r.capacity for r in live)} tokens each, kvp={self.kvp}, "
                           f"kvp_tokens={self.kvp_tokens})")]  # fmt: skip
        tp = live[0].tp
        deadline = self.ttft_min_s + self.ttft_factor * self.alone_s(tp, 0, spec.prompt.num_tokens)
        self.waiting.append(Prefilling(spec, now, deadline))
        self._held.add(rid)
        self._waiting_ids.add(rid)
        self._placement_version += 1
        return [Admit(rid, (), ""), *self._schedule(now)]

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        match event:
            case IterationDone(batch_id=bid):
                self._iteration_done(bid)
            case RequestFinished(request_id=rid) | RequestFailed(request_id=rid):
                self._drop(rid)
        self._sync(state)
        return self._schedule(now)

    def on_tick(self, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        return self._schedule(now)

    def on_instance_lost(self, instance_id: str, state: ClusterState, now: float) -> list[Action]:
        """The core failed the requests the replica held (spanning ones too: it tracks every holder); its
        iteration never reports, and the members it ran with are free again."""
        lost = self.replicas.pop(instance_id, None)
        self._placement_version += 1
        self._groups_cache = None
        for bid in [b for b, f in self.in_flight.items() if instance_id in f.replicas]:
            for iid in self.in_flight.pop(bid).replicas:
                if (r := self.replicas.get(iid)) is not None:
                    r.running = None
        if lost is not None:
            for rid in lost.reserved:
                self._drop(rid)
        self._sync(state)
        return self._schedule(now)

    # ---- iterations ----

    def _iteration_done(self, bid: int) -> None:
        ran = self.in_flight.pop(bid, None)
        if ran is None:
            return
        for iid in ran.replicas:
            if (r := self.replicas.get(iid)) is not None:
                r.running = None
        for rid, n, iid in ran.prefills:
            r = self.replicas.get(iid)
            p = next((x for x in r.queue if x.rid == rid), None) if r is not None else None
            if r is None or p is None:
                continue  # ended meanwhile
            p.done += n
            if rid in self._span_prefill:  # which replicas run together follows its progress (`_groups`)
                self._groups_cache = None
            r.pending_s = None
            if p.done >= p.prompt:
                r.queue.remove(p)
                self._span_prefill.pop(rid, None)
                start = next((s.start for s in self.spans.get(rid, ()) if s.id == iid), 0)
                r.decoding[rid] = p.prompt - start + 1  # the first token's KV is written by its first decode
            elif p.until and p.done >= p.until:  # its share here is full: the next chunks go to the next replica
                r.queue.remove(p)
                nxt = next(s for s in self.spans[rid] if s.start == p.done)
                p.until = nxt.end
                self.replicas[nxt.id].queue.append(p)
                self.replicas[nxt.id].pending_s = None
        for rid, iid in ran.decodes:
            if (r := self.replicas.get(iid)) is not None and rid in r.decoding:
                r.decoding[rid] += 1

    def _schedule(self, now: float) -> list[Action]:
        self._place(now)
        actions: list[Action] = []
        for group in self._groups():
            if not _ready(group):
                continue
            batch = self._iteration(group[0], now) if len(group) == 1 else self._group_iteration(group, now)
            if batch is not None:
                actions.append(batch)
        return actions

    def _groups(self) -> list[list[Replica]]:
        """The replicas that run their iterations together: joined by every request whose KV spans them (from its
        first chunk on a second replica), in rank order."""
        if self._groups_cache is None:
            self._groups_cache = self._join()
        return self._groups_cache

    def _join(self) -> list[list[Replica]]:
        if not self.spans:  # no request spans replicas: each runs alone
            return [[r] for r in sorted(self.replicas.values(), key=lambda x: x.rank)]
        parent = {iid: iid for iid in self.replicas}

        def root(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for rid, spans in self.spans.items():
            queued = self._span_prefill.get(rid)  # still prefilling: in some replica's queue
            done = None if queued is None else queued.done
            used = [s.id for s in spans if done is None or s.start < done or s.start == done]
            for a, b in itertools.pairwise(x for x in used if x in parent):
                parent[root(a)] = root(b)
        groups: dict[str, list[Replica]] = {}
        for r in sorted(self.replicas.values(), key=lambda x: x.rank):
            groups.setdefault(root(r.id), []).append(r)
        return list(groups.values())

    def _place(self, now: float) -> None:
        """KVP load balancer (kvp.py): waiting requests, first in first out, onto the replica (or the replicas) with
        room, the least pending prefill work first. While the first one waits for KV, later ones that fit one replica
        may pass it (backfill: the next BACKFILL_SCAN of them in one pass, so a pass costs the same however long
        the queue), holding together at most `backfill` of that replica's KV, and only on replicas where
        the waiting one would still fit beside that share: a long request waiting for room does not hold up short
        ones, and it cannot be starved by them."""
        if not self.waiting:  # every event and tick comes here
            self._clear_bypassers()
            return
        rooms = {r.id: Room(r.id, r.free(), r.block, self._pending_s(r)) for r in self.replicas.values()}
        # A pass that placed nothing places nothing again until the queue, a reservation or the replicas change, or
        # (when a request may span replicas) the order `place` tries them in: whether a span fits depends on it.
        order = (
            None if self.kvp == 1 else tuple(r.id for r in sorted(rooms.values(), key=lambda r: (r.pending_s, -r.free)))
        )
        seen = (self._placement_version, order)
        if seen == self._placement_seen:
            return
        blocked: Prefilling | None = None
        placed: set[str] = set()
        scanned = 0
        bypassable: list[Room] | None = None  # while the rooms do not change, the same for every request scanned
        too_big = math.inf  # the least KV need that found no bypassable room: a larger one cannot find one either
        for p in self.waiting:
            max_tokens = p.spec.sampling.max_tokens
            if blocked is not None:
                scanned += 1
                if scanned > BACKFILL_SCAN:  # bounded work per event, however long the queue grows
                    break
            if blocked is None:
                spans = place(list(rooms.values()), p.prompt, max_tokens, self.kvp, self.kvp_tokens)
                if spans is None:
                    blocked = p
                    continue
            else:
                if p.prompt + max_tokens >= too_big:
                    continue
                if bypassable is None:
                    bypassable = self._bypassable(blocked, rooms)
                spans = place(bypassable, p.prompt, max_tokens, 1, self.kvp_tokens)
                if spans is None:
                    too_big = p.prompt + max_tokens
                    continue
                self.bypassers.add(p.rid)
                bypassable, too_big = None, math.inf
            placed.add(p.rid)
            for s in spans:
                self.replicas[s.id].reserve(p.rid, s.reserve, p.rid in self.bypassers)
                r = rooms[s.id]
                work = self.alone_s(self.replicas[s.id].tp, s.start, s.end - s.start)
                rooms[s.id] = Room(r.id, r.free - s.reserve, r.block, r.pending_s + work)
            if len(spans) > 1:
                self.spans[p.rid] = spans
                self._groups_cache = None
                self._span_prefill[p.rid] = p
                p.until = spans[0].end
            self.replicas[spans[0].id].queue.append(p)
            self.replicas[spans[0].id].pending_s = None
        if placed:
            self.waiting = deque(p for p in self.waiting if p.rid not in placed)
            self._waiting_ids -= placed
            self._placement_version += 1
        else:
            self._placement_seen = seen
        if blocked is None:
            self._clear_bypassers()

    def _clear_bypassers(self) -> None:
        if self.bypassers:
            self._placement_version += 1
            self.bypassers.clear()
            for r in self.replicas.values():
                r.bypass_used = 0

    def _pending_s(self, r: Replica) -> float:
        """`r`'s queued prefill work, alone: recomputed only after its queue changed."""
        if r.pending_s is None:
            r.pending_s = sum(self.alone_s(r.tp, q.done, q.left) for q in r.queue)
        return r.pending_s

    def _bypassable(self, blocked: Prefilling, rooms: dict[str, Room]) -> list[Room]:
        """The replicas a request may take while `blocked` waits, each with the room left of the bypass share."""
        if self.backfill <= 0:
            return []
        need = blocked.prompt + blocked.spec.sampling.max_tokens
        out = []
        for r in self.replicas.values():
            share = int(self.backfill * r.capacity)
            if min(need, self.kvp_tokens or need, r.capacity) > r.capacity - share:
                continue  # the waiting request needs this replica's KV beyond the bypass share
            room = rooms[r.id]
            free = min(room.free, (share - r.bypass_used) // r.block * r.block)
            out.append(Room(r.id, free, r.block, room.pending_s))
        return out

    def _group_iteration(self, group: list[Replica], now: float) -> RunBatch | None:
        """One iteration over replicas that share requests (KVP): each member's own chunks, packed as alone, and its
        decodes, each computed by that member as master."""
        prefills: list[PrefillPart] = []
        decodes: list[DecodePart] = []
        for r in group:
            chunks, decoding = self._pack(r, list(r.decoding), list(r.queue), now)
            prefills += [PrefillPart(p.spec, p.done, p.done + n, (KVShard(r.id, p.done, p.done + n),), master=r.id)
                         for p, n in chunks]  # fmt: skip
            decodes += [DecodePart(rid, r.id) for rid in decoding]
        if not prefills and not decodes:
            return None
        bid = next(self._ids)
        ids = tuple(r.id for r in group)
        for r in group:
            r.running = bid
            r.iterations += 1
        parts = [(p.request_id, p.num_tokens, p.master) for p in prefills]
        self.in_flight[bid] = InFlight(ids, parts, [(d.request_id, d.master) for d in decodes])
        return RunBatch(bid, ids, prefills=tuple(prefills), decodes=tuple(decodes), kvp=True)

    def _pack(
        self, r: Replica, decoding: list[str], queue: list[Prefilling], now: float
    ) -> tuple[list[tuple[Prefilling, int]], list[str]]:
        """The chunks of `queue` (in priority order) to run beside `decoding` on `r`, packed to its target time."""
        decode_kv = sum(r.decoding[rid] for rid in decoding)
        remaining = {p.rid: self.alone_s(r.tp, p.done, p.left) for p in queue}
        order = sorted(queue, key=lambda p: priority(self.policy, p, now, remaining[p.rid]))

        def slack(p: Prefilling) -> float:
            return relative_slack(p, now, remaining[p.rid])

        limits = PackLimits(self.target_s(r.tp), self.min_chunk, self.max_chunk, self.max_share, self.max_prefills)
        return pack(self.model(), r.tp, order, len(decoding), decode_kv, limits, slack), decoding

    def _iteration(self, r: Replica, now: float) -> RunBatch | None:
        overlap = self.spp_overlap and r.spp > 1
        k = r.iterations

        def ready(rid: str) -> bool:
            """With overlap, a request sampled in one of the last spp - 1 iterations has its token in the pipeline."""
            return not overlap or k - r.sampled_at.get(rid, -r.spp) >= r.spp

        decoding = [rid for rid in r.decoding if ready(rid)]
        queue = [p for p in r.queue if ready(p.rid)]
        if not decoding and not queue:  # all in the pipeline: the next iteration waits for the oldest samples
            decoding, queue = list(r.decoding), list(r.queue)
        chunks, decoding = self._pack(r, decoding, queue, now)
        if not chunks and not decoding:
            return None
        bid = next(self._ids)
        parts = tuple(PrefillPart(p.spec, p.done, p.done + n, (KVShard(r.id, p.done, p.done + n),)) for p, n in chunks)
        decodes = tuple(DecodePart(rid, r.id) for rid in decoding)
        r.running = bid
        r.iterations += 1
        for rid in [*decoding, *(p.rid for p, n in chunks if p.done + n >= p.prompt)]:
            r.sampled_at[rid] = k
        self.in_flight[bid] = InFlight((r.id,), [(p.rid, n, r.id) for p, n in chunks], [(d, r.id) for d in decoding])
        return RunBatch(bid, (r.id,), prefills=parts, decodes=decodes, overlap=overlap)
