"""The scheduler's pure core: admission limits, request bookkeeping, events and failure handling.

No I/O: methods take the current time and return actions for an executor to carry out.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import msgspec

from spindle_protocol.messages import (
    DecodeStarted,
    InstanceInfo,
    IterationDone,
    KVMigrated,
    KVPShards,
    Preempted,
    PrefillDone,
    PrefillProgress,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    Resharded,
    TransferDone,
    WorkerEvent,
)
from spindle_protocol.registry import DEAD_AFTER_S

from .actions import (
    Action,
    Admit,
    FailRequest,
    KVShard,
    MigrateKV,
    Preempt,
    Reject,
    RunBatch,
    RunPrefill,
    ScaleDownKVP,
    TransferKV,
    decode_tokens,
)
from .merging import merged
from .state import DECODE_ROLES, PREFILL_ROLES, ClusterState, Phase, RequestState
from .strategy import Strategy

log = logging.getLogger("spindle.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_requests: int = 256  # requests in flight before admission answers 429
    dead_after_s: float = DEAD_AFTER_S  # heartbeat age that makes an instance dead
    retry_after_s: float = 1.0
    # throughput-class requests (service_class "batch") in flight, as a share of max_num_requests: the rest is
    # kept for interactive ones (a batch line refused with 429 waits and tries again)
    batch_share: float = 0.5

    def __post_init__(self) -> None:
        if self.max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {self.max_num_requests}")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if self.dead_after_s <= 0:
            raise ValueError(f"dead_after_s must be > 0, got {self.dead_after_s}")

    @property
    def max_batch_requests(self) -> int:
        return max(1, int(self.batch_share * self.max_num_requests))


class SchedulerCore:
    def __init__(self, strategy: Strategy, config: SchedulerConfig | None = None) -> None:
        self.strategy = strategy
        self.config = config or SchedulerConfig()
        self.state = ClusterState()

    # ---- instances ----

    def on_heartbeat(self, info: InstanceInfo, now: float | None = None) -> list[Action]:
        """Take an instance's heartbeat. One from a new process under a live id (restarted faster than
        `dead_after_s`) first loses the old process's requests, as its death would have: the returned actions."""
        known = self.state.instances.get(info.instance_id)
        actions: list[Action] = []
        if known is not None and (info.pid, info.started_at) != (known.info.pid, known.info.started_at):
            if info.started_at < known.info.started_at:
                return []  # a late heartbeat of the process that was replaced
            if known.alive:
                why = f"restarted (pid {known.info.pid} -> {info.pid})"
                actions = self._lose(info.instance_id, info.updated_at if now is None else now, why)
        elif info.instance_id in self.state.dead and known is not None and info.updated_at <= known.info.updated_at:
            return []
        if info.instance_id in self.state.dead:
            log.info("instance %s is back", info.instance_id)
        self.state.update_instance(info)
        return actions

    def on_instance_left(self, instance_id: str, now: float) -> list[Action]:
        inst = self.state.instances.get(instance_id)
        if inst is None or not inst.alive:
            return []
        return self._lose(instance_id, now, "left")

    def tick(self, now: float) -> list[Action]:
        """Find instances whose heartbeat stopped; fail the requests they held."""
        actions: list[Action] = []
        for inst in list(self.state.instances.values()):
            if inst.alive and now - inst.info.updated_at > self.config.dead_after_s:
                actions += self._lose(inst.id, now, f"no heartbeat for {now - inst.info.updated_at:.1f}s")
        for req in list(self.state.requests.values()):
            if now > req.spec.deadline + 5.0:  # the gateway ended it; forget it even if no event came
                self._forget(req.request_id)
        return actions + self._track(self.strategy.on_tick(self.state, now))

    def _track(self, actions: list[Action]) -> list[Action]:
        """Note what the strategy's actions change before an executor carries them out."""
        for a in actions:
            if isinstance(a, FailRequest):  # the executor ends it everywhere; the core forgets it now
                self._forget(a.request_id)
            elif isinstance(a, Preempt):
                req = self.state.requests.get(a.request_id)
                assert req is not None and req.phase is Phase.DECODE, f"preempting a request not decoding: {a}"
                req.preempting = True
            elif isinstance(a, TransferKV):
                req = self.state.requests.get(a.request_id)
                assert req is not None and req.parked_since is not None, f"moving a request not parked: {a}"
                req.moving = True
            elif isinstance(a, ScaleDownKVP):
                req = self.state.requests.get(a.request_id)
                assert req is not None and req.phase is Phase.DECODE, f"scaling down a request not decoding: {a}"
                req.merging = True
            elif isinstance(a, RunBatch):
                self._batch_planned(a)
            elif isinstance(a, RunPrefill):
                self._prefill_planned(a)
            elif isinstance(a, MigrateKV):
                req = self.state.requests.get(a.request_id)
                assert req is not None and a.src in req.decode_instances(), f"migrating KV the request lacks: {a}"
                req.moving = True
        return actions

    def _prefill_planned(self, plan: RunPrefill) -> None:
        """A strategy placed a request it admitted earlier without a plan (`Admit` with no instances: it queued the
        request itself, e.g. batch work deferred to interactive traffic): the request is now held by the plan's
        instances, and its decode blocks count as virtual usage."""
        req = self.state.requests.get(plan.spec.request_id)
        assert req is not None and not req.chunks, f"a second plan for a request: {plan.spec.request_id}"
        req.prefill_instances, req.chunks = plan.prefill_instances, plan.chunks
        req.decode_instance, req.decode_shards = plan.decode_instance, plan.decode_shards
        self._expect(req)
        if (master := self.state.instances.get(plan.decode_instance)) is not None:
            master.mastering.add(req.request_id)

    def _batch_planned(self, batch: RunBatch) -> None:
        """A per-iteration strategy sent an iteration: its prefill parts' requests are held by the group until
        their KV is retained, then by the holders the parts name (what an instance loss fails)."""
        for part in batch.prefills:
            req = self.state.requests.get(part.request_id)
            assert req is not None, f"an iteration for a request the core does not track: {part}"
            req.prefill_instances = tuple(dict.fromkeys((*req.prefill_instances, *batch.instances)))
            kept = [s for s in req.decode_shards if s.end <= part.start]
            for r in part.retain:  # a chunk after a chunk on the same instance extends its shard (one per holder)
                if kept and kept[-1].instance == r.instance and kept[-1].end == r.start:
                    kept[-1] = KVShard(r.instance, kept[-1].start, r.end)
                else:
                    kept.append(r)
            req.decode_shards, req.decode_instance = tuple(kept), kept[0].instance

    def _migrated(self, req: RequestState, event: KVMigrated) -> None:
        shards = [KVShard(event.dst if s.instance == event.instance_id else s.instance, s.start, s.end)
                  for s in req.decode_shards]  # fmt: skip
        req.decode_shards, req.decode_instance, req.moving = tuple(shards), shards[0].instance, False

    def scaled_down(self, request_id: str, instance: str, into: str) -> None:
        """A ScaleDownKVP was carried out: `instance`'s shard is `into`'s now."""
        if (req := self.state.requests.get(request_id)) is not None:
            with contextlib.suppress(ValueError):  # the leader's KVPShards came first
                req.decode_shards = merged(req.decode_shards, instance, into, req.decode_instance)
            req.merging = False
            log.info("%s: %s merged into %s (holders %s)", request_id, instance, into, req.decode_instances())

    def scale_down_refused(self, request_id: str, reason: str, now: float) -> None:
        if (req := self.state.requests.get(request_id)) is not None:
            log.info("scaling down %s refused: %s", request_id, reason)
            req.merging, req.merge_refused_at = False, now

    def moved(self, request_id: str, dst: str) -> None:
        """A TransferKV was carried out: the request now waits on `dst`."""
        req = self.state.requests.get(request_id)
        if req is None:
            return
        self._arrived(req)
        self._set_master(req, dst)
        req.moving = False
        if req.phase is not Phase.DECODE:  # `dst` may have pulled it in before this answer came back
            self._expect(req)

    def _set_master(self, req: RequestState, instance_id: str) -> None:
        """`instance_id` leads the request's decode now (its `mastering` count follows)."""
        if (old := self.state.instances.get(req.decode_instance)) is not None:
            old.mastering.discard(req.request_id)
        req.decode_instance = instance_id
        if (new := self.state.instances.get(instance_id)) is not None:
            new.mastering.add(req.request_id)

    def _kvp_placed(self, req: RequestState, event: KVPShards) -> None:
        """A KVP group's leader says where the request's KV is: the group may have placed it elsewhere than asked,
        and scale-ups and scale-downs change it. Its KV is in the group, counted by the members' own reports from their
        next heartbeats on."""
        self._arrived(req, landed=True)
        self._set_master(req, event.master)
        shards = tuple(KVShard(s.instance, s.start, s.end) for s in event.shards)
        if tuple(s.instance for s in shards) != req.decode_instances():
            log.info(
                "%s: its KV is on %d members now: %s (master %s)", req.request_id, len(shards),
                [(s.instance, s.start, s.end) for s in shards], req.decode_instance,
            )  # fmt: skip
        req.decode_shards = shards

    def move_refused(self, request_id: str, reason: str) -> None:
        """The request was no longer parked there (pulled in meanwhile, or gone)."""
        if (req := self.state.requests.get(request_id)) is not None:
            log.info("moving %s refused: %s", request_id, reason)
            req.moving = False

    def preempt_refused(self, request_id: str, reason: str) -> None:
        """The decode instance did not preempt (the request finished meanwhile, or the kvstore is full)."""
        if (req := self.state.requests.get(request_id)) is not None:
            log.info("preempting %s refused: %s", request_id, reason)
            req.preempting = False

    def _lose(self, instance_id: str, now: float, why: str) -> list[Action]:
        inst = self.state.instances[instance_id]
        self.state.mark_dead(instance_id)
        log.warning("instance %s (%s) is dead: %s", instance_id, inst.role, why)
        group = inst.info.kvp_group
        leader = self.state.instances.get(group) if group != instance_id else None
        if leader is not None and leader.alive:
            # the group's leader knows where each request's KV is now (it re-places reservations and scales tails
            # up past this plan): it fails exactly those that had a part on the dead member
            log.warning("%s was a member of KV-parallel group %s: its leader fails what it held", instance_id, group)
            return self._track(self.strategy.on_instance_lost(instance_id, self.state, now))
        lost = {instance_id}
        if group == instance_id:  # a dead leader takes its members' parts with it
            lost |= {i.id for i in self.state.instances.values() if i.info.kvp_group == group}
        actions: list[Action] = []
        rerun: list[RequestSpec] = []
        for req in list(self.state.requests.values()):
            if lost & req.holders():
                self._forget(req.request_id)
                if self._rerunnable(req, lost):
                    rerun.append(req.spec)
                else:
                    actions.append(FailRequest(req.request_id, 503, f"{inst.role} instance {instance_id} was lost"))
        actions += self._track(self.strategy.on_instance_lost(instance_id, self.state, now))
        for spec in rerun:
            actions += self._rerun(spec, now, f"{inst.role} instance {instance_id} was lost")
        return actions

    def _rerunnable(self, req: RequestState, lost: set[str]) -> bool:
        """A prefill that ran on one lost instance alone (no SP group, no other instance holding a part of it) and
        had not reached its hand-off: nothing of it survives anywhere, so it can simply run again elsewhere."""
        return (
            req.phase is Phase.PREFILL
            and len(req.prefill_instances) == 1
            and req.prefill_instances[0] in lost
            and len(req.chunks) <= 1
            and not req.decode_shards
            and req.decode_instance not in lost
        )

    def _rerun(self, spec: RequestSpec, now: float, why: str) -> list[Action]:
        """Admit `spec` again (a new plan on the live instances): request migration, as Dynamo does for a prefill."""
        actions = []
        for a in self.admit(spec, now):
            if isinstance(a, Reject):
                actions.append(FailRequest(spec.request_id, a.status, f"{why}; running it again failed: {a.reason}"))
            elif isinstance(a, Admit) and a.request_id == spec.request_id:
                log.warning("%s: running the prefill of %s again on %s", why, spec.request_id,
                            ", ".join(a.prefill_instances))  # fmt: skip
                self.state.requests[spec.request_id].reruns += 1
            elif not isinstance(a, Admit):
                actions.append(a)
        return actions

    # ---- requests ----

    def admit(self, spec: RequestSpec, now: float) -> list[Action]:
        rid = spec.request_id
        if rid in self.state.requests:
            return [Reject(rid, 400, f"request id {rid} is already in flight")]
        if not self.state.live(*PREFILL_ROLES) or not self.state.live(*DECODE_ROLES):
            return [Reject(rid, 503, "no live prefill or decode instance", self.config.retry_after_s)]
        limit = self.state.max_model_len()
        total = spec.prompt.num_tokens + spec.sampling.max_tokens
        if limit and total > limit:
            return [
                Reject(
                    rid,
                    400,
                    f"prompt ({spec.prompt.num_tokens} tokens) plus max_tokens ({spec.sampling.max_tokens}) "
                    f"exceeds the context of {limit} tokens",
                )
            ]
        if len(self.state.requests) >= self.config.max_num_requests:
            return [
                Reject(rid, 429, f"{len(self.state.requests)} requests in flight; try again", self.config.retry_after_s)
            ]
        if spec.service_class == "batch":
            batch = sum(r.spec.service_class == "batch" for r in self.state.requests.values())
            if batch >= self.config.max_batch_requests:
                return [Reject(rid, 429, f"{batch} batch requests in flight, the most kept for batch work; try "
                               "again", self.config.retry_after_s)]  # fmt: skip
        actions = self.plan(spec, now)
        plans = {a.spec.request_id: a for a in actions if isinstance(a, RunPrefill)}
        if (plan := plans.get(rid)) is not None and spec.sampling.n > 1 and self._kv_parallel(plan):
            self.state.work_done(plan.prefill_instances, rid)
            return [Reject(rid, 400, f"n = {spec.sampling.n}: this cluster decodes on KV-parallel groups, which "
                           "decode one choice per request; send n = 1")]  # fmt: skip
        if plan is not None and spec.sampling.prompt_logprobs is not None and not plan.in_one_engine:
            self.state.work_done(plan.prefill_instances, rid)
            return [Reject(rid, 400, "prompt logprobs are computed by a single-instance prefill, and this request's "
                           "plan is sequence-parallel (the strategy's choice); send it without them")]  # fmt: skip
        if plan is not None and (gap := self._capacity_gap(plan)):
            self.state.work_done(plan.prefill_instances, rid)
            return [Reject(rid, 400, f"{gap}; it needs a plan that splits its KV (SP prefill, kvp_tokens)")]
        for a in actions:
            if isinstance(a, Admit):
                plan = plans.get(rid)
                self.state.requests[rid] = RequestState(
                    spec,
                    Phase.PREFILL,
                    a.prefill_instances,
                    a.decode_instance,
                    now,
                    chunks=plan.chunks if plan else (),
                    decode_shards=plan.decode_shards if plan else (),
                )
                self._expect(self.state.requests[rid])
                if (master := self.state.instances.get(a.decode_instance)) is not None:
                    master.mastering.add(rid)
            elif isinstance(a, FailRequest):  # a strategy may give up on a request it just admitted
                self._forget(a.request_id)
        self._track([a for a in actions if isinstance(a, RunBatch | MigrateKV)])  # a per-iteration strategy's work
        return actions

    def plan(self, spec: RequestSpec, now: float) -> list[Action]:
        """The one place the core calls the strategy's `plan()`: an executor may override it to observe the call
        (the simulator times it, `plan_us`) without the core doing any I/O or timing itself."""
        return self.strategy.plan(spec, self.state, now)

    def _kv_parallel(self, plan: RunPrefill) -> bool:
        inst = self.state.instances.get(plan.decode_instance)
        return len(plan.decode_holders) > 1 or (inst is not None and bool(inst.info.kvp_group))

    def _capacity_gap(self, plan: RunPrefill) -> str:
        """Why an instance of `plan` could never hold its share of the request's KV ("" when all can)."""
        need: dict[str, int] = {}  # prompt tokens each prefill member holds by the end (its chunk shares)
        for c in plan.chunks:
            for k, iid in enumerate(c.instances):
                need[iid] = need.get(iid, 0) + c.share(k)
        decode = decode_tokens(plan.spec, plan.decode_holders)
        if len(plan.decode_holders) > 1:  # a KVP group: new tokens go wherever the group has room (scale-up)
            decode = {s.instance: s.end - s.start for s in plan.decode_holders}
            name = self.state.instances[plan.decode_instance].info.kvp_group
            group = [i for i in self.state.live("decode") if i.info.kvp_group == name]
            total = sum(i.info.kv_blocks_total for i in group)
            blocks = sum(self.state.instances[iid].blocks_for(t) for iid, t in decode.items())
            blocks += group[0].blocks_for(plan.spec.sampling.max_tokens) if group else 0
            if total and blocks > total:
                return f"KV-parallel group {name} would hold {blocks} blocks but has {total}"
        for role, tokens_by_instance in (("prefill", need), ("decode", decode)):
            for iid, tokens in tokens_by_instance.items():
                inst = self.state.instances[iid]
                blocks = inst.blocks_for(tokens)
                if inst.info.kv_blocks_total and blocks > inst.info.kv_blocks_total:
                    return (
                        f"{role} instance {iid} would hold {tokens} tokens of its KV ({blocks} blocks) but has "
                        f"{inst.info.kv_blocks_total} blocks"
                    )
        return ""

    def on_event(self, event: WorkerEvent, now: float) -> list[Action]:
        if isinstance(event, IterationDone | Resharded):  # a group's event: only the strategy keeps groups
            return self._track(self.strategy.on_event(event, self.state, now))
        req = self.state.requests.get(event.request_id)
        if req is None:
            return []
        match event:
            case PrefillProgress(tokens_done=done):
                req.tokens_done = max(req.tokens_done, done)
            case PrefillDone(finished=True):
                self._forget(req.request_id)
            case PrefillDone():
                req.phase = Phase.TRANSFER
                req.tokens_done = req.spec.prompt.num_tokens
                self.state.work_done(req.prefill_instances, req.request_id)
            case TransferDone(parked=parked):
                req.parked_since = now if parked else None
            case DecodeStarted():
                self._arrived(req, landed=True)
                req.phase = Phase.DECODE
                req.parked_since = None
                req.decoding_since = now
            case KVPShards():
                self._kvp_placed(req, event)
            case KVMigrated():
                self._migrated(req, event)
            case Preempted():
                req.phase = Phase.TRANSFER
                req.parked_since, req.decoding_since = now, None
                req.preempting = False
                req.num_preemptions += 1
                self._expect(req)
            case RequestFinished(num_output_tokens=outputs) if req.phase == Phase.DECODE:
                self._released(req, outputs)
                self._forget(req.request_id)
            case RequestFinished() | RequestFailed():
                self._forget(req.request_id)
        return self._track(self.strategy.on_event(event, self.state, now))

    def on_abort(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        req = self.state.forget(request_id)
        if req is not None:
            self.state.work_done(req.prefill_instances, request_id)
            self._arrived(req)
            if (master := self.state.instances.get(req.decode_instance)) is not None:
                master.mastering.discard(request_id)

    def _released(self, req: RequestState, outputs: int) -> None:
        """A decoding request returned its output: its blocks and batch place count as free at once (Tetris §5.2:
        slot statistics refreshed on each returned output), until each instance's next heartbeat."""
        per_choice = outputs // max(1, req.spec.sampling.n)
        sampling = msgspec.structs.replace(req.spec.sampling, max_tokens=per_choice)
        done = msgspec.structs.replace(req.spec, sampling=sampling)
        for iid, tokens in decode_tokens(done, req.decode_holders()).items():
            if (inst := self.state.instances.get(iid)) is not None:
                inst.released_blocks += inst.blocks_for(tokens)
                inst.released_running += 1

    def _expect(self, req: RequestState) -> None:
        """Count the request's decode blocks as virtual usage on its decode instances until it decodes there."""
        for iid in req.decode_instances():
            inst = self.state.instances.get(iid)
            if inst is not None and inst.role == "decode":
                inst.incoming[req.request_id] = inst.blocks_for(req.decode_tokens()[iid])

    def _arrived(self, req: RequestState, landed: bool = False) -> None:
        """The request's decode blocks stop being virtual usage: it went away, or (`landed`) its KV is in place, and
        they count as planned blocks until each instance's next heartbeat reports them."""
        for iid in req.decode_instances():
            if (inst := self.state.instances.get(iid)) is not None:
                blocks = inst.incoming.pop(req.request_id, 0)
                if landed:
                    inst.planned_blocks += blocks
