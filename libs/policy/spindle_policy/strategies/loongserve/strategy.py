"""`loongserve`: elastic sequence parallelism over one pool of elastic instances (LoongServe, SOSP'24 §5).

No instance is a prefill or a decode instance. Each iteration the global manager decides what every free group
of instances runs, in four steps (`_dispatch`):

1. Dispatching (§5.1): pending requests FCFS (`max_ooe` > 0: younger ones may pass a blocked head, Appendix A)
   while the idle instances have room for each one's whole future KV (prompt + max_tokens: no admission can
   force an eviction) and the batch's tokens stay below the compute-bound tipping point (`tipping_tokens` per
   instance). A decoding group between iterations may be preempted for more requests when Eq. 2's gain (their
   wait for decodes to end, per input token) exceeds Eq. 1's cost (the prefill's time, per output token of
   the paused decodes).
2. Elastic instance allocation (§5.2): idle instances first (and the lent groups'); then, while Eq. 3's gain
   (the prefill's time saved, per input token; unbounded while the prefill has no instance) exceeds Eq. 4's
   cost (migrating the KV off it, per input token), the decoding instance with the fewest used slots (`e_min`)
   among those that hold and master their requests whole: each request's KV migrates (MigrateKV) to the
   decoding instance outside the prefill with the most room, and decodes in that one's group afterwards; the
   prefill starts when every migration has landed (`migrate=0`: never).
3. Batching (§5.3): the dynamic program of Eq. 5 with Eq. 6's bounds (batching.py) splits the requests
   (longest first) and instances (by node, then unused slots ascending) into batches and their groups.
4. Elastic scaling plan (§5.4): each batch's KV is retained (proactive scale-down, PrefillPart's `retain`) on
   the fewest members that hold it: the master of each request (most room first) reserves its future tokens,
   the prompt fills members in order of room. After the prefill its requests decode on those members (merged
   into a group they share); the rest go idle. A decoding group scales up by an idle instance when its batch
   reaches `scale_up_batch` (decode turning compute-bound), and the masters of its requests are spread evenly;
   a member that holds nothing and masters nothing leaves its group (scale-down in decode: nothing moves).

Predictions use Eq. 7 (`latency.batch_prefill`, fitted per DoP). Decode iterations continue back to back per
group (Appendix A's greedy execution falls out: groups do not wait for each other).

Choices the paper leaves open, and the options for the other choice:
- The tipping point: `tipping_tokens` (default 8192 prompt tokens per instance of the batch's group), or with
  `tipping_tokens=0` the paper's rule: no request joins a batch whose predicted iteration (Eq. 7 on its group)
  would pass the tipping time profiled from Eq. 7 (`batching.tipping_time`).
- The decode compute-bound batch size: `scale_up_batch` (0 = the smallest power of two at which a group of
  two decodes 10 % faster than one in the latency model; never, when it has no multi-master fit).
- Baselines of §7.4.1 as options: `max_dop=1` (replication: every request on one instance), `fixed_dop=N`
  (static hybrid parallelism: every batch on N instances and no scale-down; a prefill preempts decodes).
- The DP's search: `exact_dp=0` exhaustive while small, Eq. 6's bounds beyond (batching.py says why); 1 always
  exhaustive, 2 always bounded.
- Delay execution (Appendix A) is not modelled; requests with n > 1 choices are refused (400).
- Losing an instance ends the iterations it was in; prefills not yet sent go back to the head of the queue.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from spindle_protocol.messages import (
    IterationDone,
    KVMigrated,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    WorkerEvent,
)

from ...actions import Action, Admit, DecodePart, FailRequest, KVShard, MigrateKV, PrefillPart, Reject, RunBatch
from ...latency import LatencyModel
from ...state import ClusterState
from ...strategy import Strategy, register_strategy
from .batching import eq7, plan_batches, tipping_time
from .pool import Decoding, Group, Member

ROLE = "elastic"


@dataclass
class Pending:
    spec: RequestSpec
    arrived: float

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def prompt(self) -> int:
        return self.spec.prompt.num_tokens

    @property
    def need(self) -> int:
        return self.prompt + self.spec.sampling.max_tokens


@dataclass
class PrefillRun:
    """A prefill iteration in flight (or waiting for migrations): its batch and what lent it instances."""

    batch: RunBatch
    masters: dict[str, str]  # request id -> master
    lent: list[int]  # decode groups paused for it


@register_strategy("loongserve")
class LoongServeStrategy(Strategy):
    tuning = {"decode_tp": (1, 2, 4), "max_dop": (0, 2, 4)}  # noqa: RUF012
    takes_decode_options = False
    colocated = True
    elastic = True
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        max_dop: int = 0,
        fixed_dop: int = 0,
        tipping_tokens: int = 8192,
        scale_up_batch: int = 0,
        max_ooe: int = 0,
        preempt: int = 1,
        migrate: int = 1,
        exact_dp: int = 0,
    ) -> None:
        super().__init__(latency)
        assert self.latency is not None and self.latency.prefill is not None
        if self.latency.batch_prefill is None:
            raise ValueError("loongserve needs Eq. 7 (a latency model with batch_prefill coefficients)")
        for name, value in (("max_dop", max_dop), ("fixed_dop", fixed_dop), ("max_ooe", max_ooe)):
            if value < 0:
                raise ValueError(f"loongserve: {name} must be >= 0, got {value}")
        if tipping_tokens < 0 or scale_up_batch < 0:
            raise ValueError("loongserve: tipping_tokens and scale_up_batch must be >= 0")
        if fixed_dop and max_dop and fixed_dop > max_dop:
            raise ValueError(f"loongserve: fixed_dop {fixed_dop} exceeds max_dop {max_dop}")
        self.max_dop, self.fixed_dop, self.tipping_tokens = max_dop, fixed_dop, tipping_tokens
        if exact_dp not in (0, 1, 2):
            raise ValueError(f"loongserve: exact_dp must be 0 (auto), 1 (exhaustive) or 2 (bounded), got {exact_dp}")
        self.max_ooe, self.preempt, self.migrate, self.exact_dp = max_ooe, bool(preempt), bool(migrate), exact_dp
        self._scale_up_given = scale_up_batch
        self.scale_up_batch = scale_up_batch
        self.coeffs = dict(self.latency.batch_prefill.coeffs)
        if fixed_dop and fixed_dop not in self.coeffs:
            raise ValueError(f"loongserve: no Eq. 7 fit at fixed_dop={fixed_dop} (have {sorted(self.coeffs)})")
        self.tipping_s = 0.0 if tipping_tokens else tipping_time(self.coeffs)
        self.members: dict[str, Member] = {}
        self.pending: deque[Pending] = deque()
        self.decoding: dict[str, Decoding] = {}
        self._forgotten_seen = 0  # of ClusterState.forgotten_total
        self.groups: dict[int, Group] = {}
        self.prefills: dict[int, PrefillRun] = {}  # batch id -> prefill in flight
        self.waiting: list[PrefillRun] = []  # prefills waiting for their migrations
        self.decode_batches: dict[int, tuple[int, list[str]]] = {}  # batch id -> (group id, its requests)
        self._ids = itertools.count(1)
        self._ooe = 0  # dispatches that passed the oldest request since it last went
        self._decode_times: list[float] = []  # decode-phase time of finished requests (AvgLat_d)
        self._moving: dict[tuple[str, str], int] = {}  # (request id, src) -> group id, for MigrateKV in flight
        self._tp, self._kv_bytes = 1, 0  # the elastic instances' TP degree and KV bytes per token

    def options(self) -> dict[str, object]:
        return {
            "max_dop": self.max_dop, "fixed_dop": self.fixed_dop, "tipping_tokens": self.tipping_tokens,
            "scale_up_batch": self._scale_up_given, "max_ooe": self.max_ooe, "preempt": int(self.preempt),
            "migrate": int(self.migrate), "exact_dp": self.exact_dp,
        }  # fmt: skip

    def describe(self) -> str:
        defaults = {"tipping_tokens": 8192, "preempt": 1, "migrate": 1}
        opts = {k: v for k, v in self.options().items() if defaults.get(k, 0) != v}
        return f"{self.name}:{','.join(f'{k}={v}' for k, v in opts.items())}" if opts else self.name

    # ---- the pool as heartbeats show it ----

    def _sync(self, state: ClusterState) -> None:
        """Take in new elastic instances; drop requests the core no longer tracks (aborted, failed)."""
        for inst in state.live(ROLE):
            if inst.id not in self.members:
                info = inst.info
                blocks, size = info.kv_blocks_total, info.block_size or 1
                self.members[inst.id] = Member(inst.id, info.node, info.rank, blocks, size)
                self._tp = info.tp_size
                self._kv_bytes = info.kv_bytes_per_token
        if not self._scale_up_given and not self.scale_up_batch:
            self.scale_up_batch = self._derive_scale_up()
        ended = state.forgotten_since(self._forgotten_seen)
        self._forgotten_seen = state.forgotten_total
        if ended is None:  # more ended than the state keeps: check every request against it
            ended = [rid for rid in self.decoding if rid not in state.requests]
            ended += [p.rid for p in self.pending if p.rid not in state.requests]
        others = [rid for rid in ended if rid not in self.decoding]  # perhaps still pending (rare: a failure)
        for rid in ended:
            if rid in self.decoding:
                self._drop(rid)
        if others and self.pending:
            self.pending = deque(p for p in self.pending if p.rid in state.requests)

    def _derive_scale_up(self) -> int:
        decode = self.latency.decode if self.latency else None
        tp = self._tp
        if decode is None or (tp, 2) not in decode.coeffs or (tp, 1) not in decode.coeffs:
            return 1 << 30
        for b in (2**k for k in range(1, 12)):
            if decode.predict(b, b * 4096, tp, 2) < 0.9 * decode.predict(b, b * 4096, tp, 1):
                return b
        return 1 << 30

    def _drop(self, rid: str) -> None:
        """`rid` ended: its KV and reservations free, it leaves its group."""
        self.decoding.pop(rid, None)
        for m in self.members.values():
            m.drop(rid)
        for g in self.groups.values():
            if rid in g.requests:
                g.requests.remove(rid)

    # ---- the strategy interface ----

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        rid = spec.request_id
        live = [m for m in self.members.values() if m.id not in state.dead]
        if not live:
            return [Reject(rid, 503, "no live elastic instance")]
        if spec.sampling.n > 1:
            return [Reject(rid, 400, "loongserve decodes one choice per request; send n = 1")]
        pool = sum(m.total_blocks * m.block_size for m in live)
        largest = max(m.total_blocks * m.block_size for m in live)
        need = spec.prompt.num_tokens + spec.sampling.max_tokens
        cap = self.fixed_dop or self.max_dop
        if cap:  # a batch spans at most `cap` instances: the largest ones bound a request
            pool = sum(sorted((m.total_blocks * m.block_size for m in live), reverse=True)[:cap])
        pool -= len(live) * max(m.block_size for m in live)  # a shard per member rounds up to a block
        if need > pool or spec.sampling.max_tokens > largest:
            return [Reject(rid, 400, f"prompt plus max_tokens ({need} tokens) does not fit the elastic pool "
                           f"({pool} tokens, at most {largest} on one instance)")]  # fmt: skip
        self.pending.append(Pending(spec, now))
        return [Admit(rid, (), ""), *self._schedule(now)]

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        if isinstance(event, RequestFinished) and (d := self.decoding.get(event.request_id)) is not None:
            self._decode_times.append(now - d.started)  # AvgLat_d (Eq. 2), before _sync forgets it
        self._sync(state)
        match event:
            case IterationDone(batch_id=bid):
                self._iteration_done(bid, now)
            case RequestFinished(request_id=rid):
                self._drop(rid)
                self._release_empty()
            case RequestFailed(request_id=rid):
                self._drop(rid)
                self._release_empty()
            case KVMigrated():
                self._migrated(event)
            case _:
                return []
        return self._schedule(now)

    def on_tick(self, state: ClusterState, now: float) -> list[Action]:
        self._sync(state)
        self._release_empty()
        return self._schedule(now)

    def on_instance_lost(self, instance_id: str, state: ClusterState, now: float) -> list[Action]:
        """The core failed the requests the instance held. Iterations it was part of never report: their groups
        free, the prefills they lent instances to end, and prefills not yet started give their requests back to
        the queue; the pool plans on without it."""
        lost = self.members.pop(instance_id, None)
        for bid, run in list(self.prefills.items()):
            if instance_id in run.batch.instances:
                del self.prefills[bid]
                self._end_run(run)
        for run in [r for r in self.waiting if instance_id in r.batch.instances]:
            self.waiting.remove(run)
            self._end_run(run)
            for part in reversed(run.batch.prefills):  # never sent: they wait again, first in line
                for m in self.members.values():
                    m.drop(part.request_id)
                if part.request_id in state.requests:
                    self.pending.appendleft(Pending(part.spec, now))
        for bid, (gid, _) in list(self.decode_batches.items()):
            g = self.groups.get(gid)
            if g is None or instance_id in g.members:
                del self.decode_batches[bid]
                if g is not None:
                    g.running = None
                    for m in g.members:
                        if m in self.members:
                            self.members[m].busy = False
        failed: list[Action] = []
        for key in [k for k in self._moving if instance_id in k[1:] or (lost and k[0] in lost.held)]:
            del self._moving[key]
            if key[1] != instance_id and key[0] in state.requests:  # its KV was on its way to the lost instance
                failed.append(FailRequest(key[0], 503, f"elastic instance {instance_id} was lost"))
        for g in self.groups.values():
            if instance_id in g.members:
                g.members.remove(instance_id)
            g.migrating = sum(1 for gid in self._moving.values() if gid == g.id)
        self._sync(state)
        for a in failed:
            self._drop(a.request_id)  # type: ignore[attr-defined]
        self._release_empty()
        return failed + self._schedule(now)

    def _end_run(self, run: PrefillRun) -> None:
        """A prefill that will never report: the groups it paused go on, its members are free."""
        for g in self.groups.values():
            g.paused_for.discard(run.batch.batch_id)
        for mid in run.batch.instances:
            if mid in self.members:
                self.members[mid].busy = False

    # ---- iterations ending ----

    def _iteration_done(self, bid: int, now: float) -> None:
        if (ran := self.decode_batches.pop(bid, None)) is not None:
            gid, rids = ran
            g = self.groups.get(gid)
            if g is None:
                return
            g.running = None
            for mid in g.members:
                if mid in self.members:
                    self.members[mid].busy = False
            for rid in rids:
                if (d := self.decoding.get(rid)) is None:
                    continue
                d.outputs += 1
                m = self.members.get(d.master)
                if m is not None and m.reserved.get(rid, 0) > 0:
                    m.set(rid, held=m.held.get(rid, 0) + 1, reserved=m.reserved[rid] - 1)
            self._release_empty()
            return
        run = self.prefills.pop(bid, None)
        if run is None:
            return
        for mid in run.batch.instances:
            if mid in self.members:
                self.members[mid].busy = False
        holders: set[str] = set()
        started: list[str] = []
        for part in run.batch.prefills:
            rid = part.request_id
            if not any(rid in m.held or rid in m.reserved for m in self.members.values()):
                continue  # ended meanwhile
            if part.spec.sampling.max_tokens <= 1:
                self._drop(rid)
                continue
            master = run.masters[rid]
            self.decoding[rid] = Decoding(rid, part.spec.prompt.num_tokens, part.spec.sampling.max_tokens, master, now)
            holders |= {s.instance for s in part.retain} | {master}
            started.append(rid)
        for g in self.groups.values():  # by batch id: a lent group may have merged into another since
            g.paused_for.discard(bid)
        if started:
            self._join_groups(started, holders)
        self._release_empty()

    def _join_groups(self, rids: list[str], holders: set[str]) -> None:
        """New decoding requests decode on their holders, merged with every group those already belong to."""
        merged = {self.members[h].group for h in holders if h in self.members} - {None}
        members = set(holders)
        requests = list(rids)
        paused: set[int] = set()
        for gid in sorted(merged):  # type: ignore[type-var]
            g = self.groups.pop(gid)  # type: ignore[arg-type]
            assert g.running is None, f"merging group {gid} while it runs"
            members |= set(g.members)
            requests = g.requests + requests
            paused |= g.paused_for  # still lent to another prefill: the merged group waits for it too
        gid = next(self._ids)
        ordered = sorted((m for m in members if m in self.members), key=lambda m: self.members[m].rank)
        self.groups[gid] = Group(gid, ordered, requests, paused_for=paused)
        for m in ordered:
            self.members[m].group = gid

    def _release_empty(self) -> None:
        """Members of a group between iterations that hold and master nothing go idle; empty groups end."""
        for gid, g in list(self.groups.items()):
            if g.running is not None or g.paused_for or g.migrating:
                continue
            masters = {self.decoding[r].master for r in g.requests if r in self.decoding}
            keep = [m for m in g.members if m in self.members and (self.members[m].held or m in masters)]
            for m in set(g.members) - set(keep):
                if m in self.members:
                    self.members[m].group = None
            g.members = keep
            if not g.requests or not keep:
                for m in keep:
                    self.members[m].group = None
                del self.groups[gid]

    def _migrated(self, event: KVMigrated) -> None:
        """A request's KV landed on `dst` (its room there claimed when the move was planned): it decodes in the
        group `dst` belongs to (from that group's next iteration), or alone there."""
        rid, src, dst = event.request_id, event.instance_id, event.dst
        self._moving.pop((rid, src), None)
        waiting = {i for r in self.waiting for i in r.batch.instances}  # e_min stays taken for its prefill
        if (m := self.members.get(src)) is not None and not any(k[1] == src for k in self._moving):
            m.busy = src in waiting
        t = self.members.get(dst)
        if rid not in self.decoding or t is None:
            return
        if t.group is not None and t.group in self.groups:
            self.groups[t.group].requests.append(rid)
            return
        gid = next(self._ids)  # its group ended meanwhile: it decodes there alone, after any prefill using dst
        runs = [*self.prefills.values(), *self.waiting]
        self.groups[gid] = Group(
            gid, [dst], [rid], paused_for={r.batch.batch_id for r in runs if dst in r.batch.instances}
        )
        t.group = gid

    # ---- one scheduling round ----

    def _schedule(self, now: float) -> list[Action]:
        actions: list[Action] = []
        actions += self._start_waiting()
        if self.pending and not self.waiting and not self._moving:
            actions += self._dispatch(now)
        for g in list(self.groups.values()):
            busy = any(self.members[m].busy for m in g.members)  # a member still in a prefill or migration
            if g.running is None and not g.paused_for and not g.migrating and g.requests and not busy:
                self._maybe_scale_up(g)
                actions.append(self._decode_iteration(g))
        return actions

    def _decode_iteration(self, g: Group) -> RunBatch:
        bid = next(self._ids)
        parts = tuple(DecodePart(rid, self.decoding[rid].master) for rid in g.requests)
        g.running = bid
        self.decode_batches[bid] = (g.id, list(g.requests))
        for m in g.members:
            self.members[m].busy = True
        return RunBatch(bid, tuple(g.members), decodes=parts)

    def _maybe_scale_up(self, g: Group) -> None:
        """§5.4 scale-up: a batch past the compute-bound size takes an idle instance, and masters spread evenly
        over the members with room (each new master reserves its requests' remaining tokens)."""
        if len(g.requests) < self.scale_up_batch or self.pending or self.fixed_dop:
            return
        if self.max_dop and len(g.members) >= self.max_dop:
            return
        if (
            self.latency.decode is None
            or (self._tp, len(g.members) + 1)  # type: ignore[union-attr]
            not in self.latency.decode.coeffs
        ):  # type: ignore[union-attr]
            return
        idle = [m for m in self.members.values() if m.group is None and not m.busy]
        if not idle:
            return
        new = max(idle, key=lambda m: m.free_tokens())
        new.group = g.id
        g.members.append(new.id)
        per = math.ceil(len(g.requests) / len(g.members))
        load = {m: 0 for m in g.members}
        for rid in g.requests:
            load[self.decoding[rid].master] = load.get(self.decoding[rid].master, 0) + 1
        for rid in g.requests:
            d = self.decoding[rid]
            if load[d.master] <= per:
                continue
            old = self.members[d.master]
            target = min((self.members[m] for m in g.members), key=lambda m: load[m.id])
            if load[target.id] >= per or not target.room_for(rid, d.left):
                continue
            old.unreserve(rid)
            target.set(rid, reserved=d.left)
            load[d.master] -= 1
            load[target.id] += 1
            d.master = target.id

    # ---- the four steps ----

    def _idle(self) -> list[Member]:
        return [m for m in self.members.values() if m.group is None and not m.busy]

    def _fitted_dop(self, dop: int) -> int | None:
        """The largest DoP Eq. 7 is fitted at, not above `dop` (None: none is)."""
        return max((p for p in self.coeffs if p <= dop), default=None)

    def _t(self, lens: list[int], dop: int) -> float:
        """Eq. 7 for a batch on `dop` instances (the largest fitted DoP not above it)."""
        fitted = self._fitted_dop(dop)
        if fitted is None or not lens:
            return math.inf
        return eq7(self.coeffs, fitted, float(sum(lens)), float(sum(x * x for x in lens)))

    def _dispatch(self, now: float) -> list[Action]:
        idle = self._idle()
        chosen = self._select(idle, [])
        lent: list[Group] = []
        if self.preempt or self.fixed_dop:
            lent, chosen = self._preempt(idle, chosen, now)
        group = idle + [self.members[m] for g in lent for m in g.members]
        if self.fixed_dop:
            group = self._fixed_group(group)
        moves: list[Action] = []
        if self.migrate and not self.fixed_dop:
            head = chosen or self._pool_head()
            for e, g, plan in self._allocate_more(head, group) if head else []:
                moves += self._commit_drain(e, g, plan)
                group.append(e)
            if moves and not chosen:
                chosen = self._select(group, [])
        if not chosen or not group:
            return moves
        runs = self._batch(chosen, group, lent)
        if not runs:
            return moves
        taken = {p.request_id for r in runs for p in r.batch.prefills}
        self.pending = deque(p for p in self.pending if p.rid not in taken)
        if not moves:
            return self._start(runs)
        self.waiting.extend(runs)
        for r in runs:  # their members wait for the prefill (lent groups pause, idle members are taken)
            for gid in r.lent:
                self.groups[gid].paused_for.add(r.batch.batch_id)
            for mid in r.batch.instances:
                self.members[mid].busy = True
        return moves

    def _pool_head(self) -> list[Pending]:
        """The oldest pending request, when its whole future KV fits the pool (for step 2 to find it room)."""
        pool = sum(m.free_tokens() for m in self.members.values())
        return [self.pending[0]] if self.pending and self.pending[0].need <= pool else []

    def _fixed_group(self, group: list[Member]) -> list[Member]:
        """Static hybrid parallelism: a batch runs on exactly `fixed_dop` instances or waits."""
        return sorted(group, key=lambda m: m.rank)[: self.fixed_dop] if len(group) >= self.fixed_dop else []

    def _select(self, members: list[Member], already: list[Pending]) -> list[Pending]:
        """Step 1: pending requests (FCFS, or out of order up to `max_ooe` times) whose whole future KV fits the
        room left on `members` and in the pool, until the batch passes the tipping point."""
        taken = {p.rid for p in already}
        room = sum(m.free_tokens() for m in members) - sum(p.need for p in already)  # `already` lands on them
        pool = sum(m.free_tokens() for m in self.members.values()) - sum(p.need for p in already)
        tokens = sum(p.prompt for p in already)
        squares = float(sum(p.prompt * p.prompt for p in already))
        width = max(1, len(members))
        dop = self._fitted_dop(width) or min(self.coeffs)
        out: list[Pending] = []
        passed = False
        for p in self.pending:
            if p.rid in taken:
                continue
            fits = p.need <= room and p.need <= pool
            if not (out or already):
                over = False
            elif self.tipping_s:  # the paper's rule: the batch's predicted iteration past the tipping time
                over = eq7(self.coeffs, dop, tokens + p.prompt, squares + p.prompt * p.prompt) > self.tipping_s
            else:
                over = tokens + p.prompt > self.tipping_tokens * width
            if fits and not over:
                out.append(p)
                room, pool, tokens = room - p.need, pool - p.need, tokens + p.prompt
                squares += p.prompt * p.prompt
                continue
            if over or self._ooe >= self.max_ooe:
                break
            passed = True  # the head is blocked: a younger one may go (relaxed FCFS)
        if out:
            self._ooe = self._ooe + 1 if passed else 0
        return out

    def _preempt(self, idle: list[Member], chosen: list[Pending], now: float) -> tuple[list[Group], list[Pending]]:
        """Step 1, Eq. 1-2: decoding groups between iterations lent to this prefill when it gains more input
        latency than it costs the paused decodes (static hybrid: always)."""
        lent: list[Group] = []
        free = [g for g in self.groups.values() if g.running is None and not g.paused_for and not g.migrating]
        free.sort(key=lambda g: -sum(self.members[m].free_tokens() for m in g.members))
        avg = sum(self._decode_times) / len(self._decode_times) if self._decode_times else 0.0
        group = list(idle)
        for g in free:
            members = [self.members[m] for m in g.members]
            extra = self._select(group + members, chosen)
            if not extra:
                continue
            if not self.fixed_dop:
                lens = [p.prompt for p in chosen + extra]
                t = self._t(lens, len(group) + len(members))
                cost = sum(t / max(1, self.decoding[r].max_tokens) for r in g.requests)
                waited = min((now - self.decoding[r].started for r in g.requests), default=0.0)
                gain = sum(max(0.0, avg - waited) / max(1, p.prompt) for p in extra)
                if gain <= cost:
                    continue
            lent.append(g)
            group += members
            chosen = chosen + extra
        return lent, chosen

    def _allocate_more(self, chosen: list[Pending], group: list[Member]) -> list[tuple[Member, Group, list[MigrateKV]]]:
        """Step 2, Eq. 3-4: add e_min, the decoding instance (of a group between iterations) with the fewest used
        slots whose requests it holds whole and that other decoding instances can take, while the prefill time it
        saves (from none at all, with no instance yet) beats migrating its KV. Each request moves to the decoding
        instance outside the prefill with the most unused slots, and decodes in that one's group afterwards.
        Returns the instances with their migrations (not yet sent)."""
        transfer = self.latency.transfer if self.latency else None
        if not self._kv_bytes or transfer is None:
            return []
        lens = [p.prompt for p in chosen]
        out: list[tuple[Member, Group, list[MigrateKV]]] = []
        taken = {m.id for m in group}
        cap = self.max_dop or len(self.members)
        while len(taken) < cap:
            cands = []
            for g in self.groups.values():
                if g.running is not None or g.paused_for or g.migrating:
                    continue
                mine = set(g.requests)
                for mid in g.members:
                    e = self.members[mid]
                    here = e.held.keys() | e.reserved.keys()
                    if mid in taken or e.busy or not here <= mine or not all(self._only_on(r, mid) for r in here):
                        continue
                    cands.append((e.kv_tokens(), e.rank, e, g))
            if not cands:
                break
            used, _, e, g = min(cands, key=lambda c: c[:2])
            n = len(taken)
            gain = sum((self._t(lens, n) - self._t(lens, n + 1)) / max(1, x) for x in lens)
            cost = sum(transfer.predict(used * self._kv_bytes) / max(1, x) for x in lens)
            moves = self._drain_plan(e, taken) if gain > cost else None
            if moves is None:
                break
            out.append((e, g, moves))
            taken.add(e.id)
        return out

    def _only_on(self, rid: str, mid: str) -> bool:
        """`rid`'s KV is all on `mid`, and `mid` masters it."""
        d = self.decoding.get(rid)
        elsewhere = any(rid in m.held for m in self.members.values() if m.id != mid)
        return d is not None and d.master == mid and not elsewhere

    def _drain_plan(self, e: Member, taken: set[str]) -> list[MigrateKV] | None:
        """MigrateKV moving every request off `e`, each to the decoding instance outside the prefill with the most
        room (its KV and remaining tokens claimed there now); None, and nothing claimed, when one does not fit."""
        targets = [m for m in self.members.values() if m.group is not None and m.id != e.id and m.id not in taken]
        plan: list[MigrateKV] = []
        claimed: list[tuple[Member, str]] = []
        for rid, tokens in list(e.held.items()):
            left = self.decoding[rid].left
            fit = [m for m in targets if m.room_for(rid, tokens + left)]
            if not fit:
                for m, r in claimed:
                    m.drop(r)
                return None
            target = max(fit, key=lambda m: (m.free_tokens(), -m.rank))
            target.set(rid, held=tokens, reserved=left)
            claimed.append((target, rid))
            plan.append(MigrateKV(rid, e.id, target.id))
        return plan

    def _commit_drain(self, e: Member, g: Group, moves: list[MigrateKV]) -> list[Action]:
        """`e` leaves `g` for the prefill; its requests leave `g` and decode where their KV lands (KVMigrated)."""
        g.members.remove(e.id)
        e.group = None
        e.busy = True
        for a in moves:
            self._moving[(a.request_id, a.src)] = g.id
            g.requests.remove(a.request_id)
            e.drop(a.request_id)  # its blocks are free by the time the prefill starts (after every migration)
            self.decoding[a.request_id].master = a.dst
        if not g.members:
            del self.groups[g.id]
        return list(moves)

    def _batch(self, chosen: list[Pending], group: list[Member], lent: list[Group]) -> list[PrefillRun]:
        """Steps 3-4: the DP's batches, each with its retain plan."""
        reqs = sorted(chosen, key=lambda p: -p.prompt)
        ins = sorted(group, key=lambda m: (m.node, m.free_tokens(), m.rank))
        coeffs = self.coeffs
        if self.max_dop:
            coeffs = {p: c for p, c in coeffs.items() if p <= self.max_dop}
        if self.fixed_dop:
            coeffs = {self.fixed_dop: self.coeffs[self.fixed_dop]}
        lens = [p.prompt for p in reqs]
        exact = True if self.exact_dp == 1 else False if self.exact_dp == 2 else None
        _, cuts = plan_batches(lens, [p.need for p in reqs], [m.free_tokens() for m in ins], coeffs, exact)
        runs = []
        for cut in cuts:
            batch_reqs = reqs[cut.req_start : cut.req_end]
            members = ins[cut.ins_start : cut.ins_end]
            run = self._retain(batch_reqs, members, [g.id for g in lent])
            if run is None:
                continue
            runs.append(run)
        for run in runs:  # a lent group pauses until every prefill using one of its members ends
            run.lent = [gid for gid in run.lent if set(run.batch.instances) & set(self.groups[gid].members)]
        return runs

    def _retain(self, reqs: list[Pending], members: list[Member], lent: list[int]) -> PrefillRun | None:
        """Step 4, scale-down: each request's master (most room) reserves its future tokens; its prompt fills
        members in order of room (the master first), so the KV stays on the fewest members. Static hybrid
        parallelism (`fixed_dop`) spreads every prompt evenly over all members instead."""
        claims: dict[str, dict[str, int]] = {}
        parts, masters = [], {}
        for p in reqs:
            rid, left = p.rid, p.spec.sampling.max_tokens - 1
            if self.fixed_dop:
                order = list(members)
                n = len(order)
                shares = [p.prompt // n + (1 if k < p.prompt % n else 0) for k in range(n)]
            else:
                order = sorted(members, key=lambda m: -m.free_tokens())
                shares = []
            master = order[-1] if self.fixed_dop else order[0]
            if not master.room_for(rid, left):
                return self._undo(claims)
            master.set(rid, reserved=left)
            claims.setdefault(master.id, {})[rid] = 0
            masters[rid] = master.id
            shards, pos = [], 0
            for k, m in enumerate(order):
                if pos >= p.prompt:
                    break
                take = shares[k] if self.fixed_dop else min(p.prompt - pos, m.room_tokens(rid))
                if take <= 0:
                    continue
                m.set(rid, held=m.held.get(rid, 0) + take)
                claims.setdefault(m.id, {})[rid] = take
                shards.append(KVShard(m.id, pos, pos + take))
                pos += take
            if pos < p.prompt or any(m.used_blocks() > m.total_blocks for m in order):
                return self._undo(claims)
            parts.append(PrefillPart(p.spec, 0, p.prompt, tuple(shards)))
        bid = next(self._ids)
        ids = tuple(m.id for m in sorted(members, key=lambda m: m.rank))
        return PrefillRun(RunBatch(bid, ids, prefills=tuple(parts)), masters, lent)

    def _undo(self, claims: dict[str, dict[str, int]]) -> None:
        for mid, rids in claims.items():
            for rid in rids:
                self.members[mid].drop(rid)
        return None

    def _start(self, runs: list[PrefillRun]) -> list[Action]:
        actions: list[Action] = []
        for run in runs:
            self.prefills[run.batch.batch_id] = run
            for mid in run.batch.instances:
                self.members[mid].busy = True
            for gid in run.lent:
                self.groups[gid].paused_for.add(run.batch.batch_id)
            actions.append(run.batch)
        return actions

    def _start_waiting(self) -> list[Action]:
        """Prefills waiting for migrations start when every migration has landed."""
        if not self.waiting or self._moving:
            return []
        ready, self.waiting = self.waiting, []
        return self._start(ready)
