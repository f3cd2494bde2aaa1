"""The scheduler's NATS shell: feeds admissions, events and heartbeats to the core and executes actions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, Status, StatusCode

from spindle_policy.actions import (
    Action,
    Admit,
    FailRequest,
    MigrateKV,
    Preempt,
    Reject,
    Reshard,
    RunBatch,
    RunPrefill,
    TransferKV,
    shard_specs,
)
from spindle_policy.actions import ScaleDownKVP as ScaleDownAction
from spindle_policy.core import SchedulerConfig, SchedulerCore
from spindle_policy.decisions import decision
from spindle_policy.latency import LatencyModel
from spindle_policy.strategy import create_strategy
from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    Abort,
    AdmitReply,
    AdmitRequest,
    ClusterStatus,
    InstanceInfo,
    IterationDecode,
    IterationPrefill,
    MigrateKVIn,
    MoveParked,
    MoveReply,
    PlaceKVP,
    PreemptDecode,
    PreemptReply,
    Resharded,
    ReshardInstance,
    RunIteration,
    ScaleDownKVP,
    ScaleDownReply,
    SPChunkSpec,
    StackRestarts,
    StatusQuery,
    StreamEvent,
    WorkerEvent,
)
from spindle_protocol.messages import RunPrefill as RunPrefillMsg
from spindle_protocol.registry import watch_registry
from spindle_telemetry import extract, inject, setup, shutdown, tracer

log = logging.getLogger("spindle.scheduler")

PREEMPT_TIMEOUT_S = 30.0  # storing a long request's KV in the kvstore is a large transfer


@dataclass(frozen=True)
class SchedulerServiceConfig:
    nats_url: str
    strategy: str = "single"
    core: SchedulerConfig = field(default_factory=SchedulerConfig)
    otlp_endpoint: str | None = None
    model: str = ""
    latency: LatencyModel | None = None  # for strategies that plan with predicted times (`--profile`)


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        strategy = create_strategy(config.strategy, config.latency)
        if gap := type(strategy).stack_gap(strategy.options()):
            raise ValueError(
                f"strategy {strategy.describe()!r} cannot run on the services yet: {gap}; use it in `spindle sim`"
            )
        self.core = SchedulerCore(strategy, config.core)
        self.strategy_name = strategy.describe()
        self.bus: Bus | None = None
        self._tasks: set[asyncio.Task] = set()
        self._plan_lock = asyncio.Lock()
        self.reshards: dict[str, int] = {}  # Resharded events so far, per configuration switched to
        self.reshard_seconds = 0.0
        self.worker_restarts: dict[str, int] = {}  # the launcher's totals (StackRestarts)

    async def run(self, stop: asyncio.Event) -> None:
        setup("spindle-scheduler", self.config.otlp_endpoint)
        self.bus = bus = await Bus.connect(self.config.nats_url, "spindle-scheduler", inject=inject)
        await bus.subscribe(subjects.ADMIT, AdmitRequest, self._on_admit)
        await bus.subscribe(subjects.STATUS, StatusQuery, self._on_status)
        await bus.subscribe(subjects.EVENTS, WorkerEvent, self._on_event)
        await bus.subscribe(subjects.ABORT, Abort, self._on_abort)
        await bus.subscribe(subjects.RESTARTS, StackRestarts, self._on_restarts)
        tasks = [
            asyncio.create_task(watch_registry(bus, self._on_registry)),
            asyncio.create_task(self._tick_loop()),
        ]
        log.info("scheduler ready (strategy %s) on %s", self.config.strategy, self.config.nats_url)
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await bus.close()
            shutdown()

    # ---- inputs ----

    def _on_registry(self, info: InstanceInfo | None, key: str) -> None:
        if info is None:
            self._spawn(self._execute(self.core.on_instance_left(key, time.time())))
        elif actions := self.core.on_heartbeat(info, time.time()):
            self._spawn(self._execute(actions))

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self._execute(self.core.tick(time.time()))

    async def _on_admit(self, msg: AdmitRequest, raw: Msg) -> AdmitReply:
        spec = msg.request
        scheduler = tracer("spindle.scheduler")
        with scheduler.start_as_current_span(
            "scheduler.admit", context=extract(raw.headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("spindle.request_id", spec.request_id)
            span.set_attribute("spindle.prompt_tokens", spec.prompt.num_tokens)
            span.set_attribute("spindle.strategy", self.config.strategy)
            with scheduler.start_as_current_span("scheduler.plan") as plan:
                actions = self.core.admit(spec, time.time())
                plan.set_attribute("spindle.actions", [type(a).__name__ for a in actions])
            reply = AdmitReply(accepted=False, status=500, reason="strategy returned no decision")
            for a in actions:
                if isinstance(a, Reject):
                    span.set_attribute("spindle.rejected", a.reason)
                    reply = AdmitReply(accepted=False, status=a.status, reason=a.reason, retry_after_s=a.retry_after_s)
                elif isinstance(a, Admit):
                    reply = AdmitReply(
                        accepted=True, prefill_instance=a.prefill_instance, decode_instance=a.decode_instance
                    )
            span.set_attribute("spindle.accepted", reply.accepted)
            if not reply.accepted:  # the request ends here: the span says why
                span.set_status(Status(StatusCode.ERROR, reply.reason))
            await self._publish_decisions([a for a in actions if isinstance(a, Reject)])
            await self._execute([a for a in actions if not isinstance(a, Admit | Reject)])
        return reply

    async def _on_status(self, msg: StatusQuery, raw: Msg) -> ClusterStatus:
        state = self.core.state
        return ClusterStatus(
            instances=[i.info for i in state.instances.values() if i.alive],
            dead_instances=sorted(state.dead),
            num_requests_running=state.num_running(),
            num_requests_waiting=state.num_waiting(),
            strategy=self.config.strategy,
            max_model_len=state.max_model_len(),
            model=self.config.model,
            reshards=dict(self.reshards),
            reshard_seconds=self.reshard_seconds,
            worker_restarts=dict(self.worker_restarts),
        )

    async def _on_event(self, event: WorkerEvent, raw: Msg) -> None:
        log.debug("event: %r", event)
        if isinstance(event, Resharded):
            self.reshards[event.config] = self.reshards.get(event.config, 0) + 1
            self.reshard_seconds += event.seconds
        await self._execute(self.core.on_event(event, time.time()))

    async def _on_restarts(self, msg: StackRestarts, raw: Msg) -> None:
        for role, n in msg.restarts.items():  # totals only grow: an older message never lowers one
            self.worker_restarts[role] = max(n, self.worker_restarts.get(role, 0))

    async def _on_abort(self, msg: Abort, raw: Msg) -> None:
        self.core.on_abort(msg.request_id)

    # ---- outputs ----

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_prefill(self, a: RunPrefill) -> None:
        """Send the plan to its instance, or to every member of an SP plan, all before the next plan: members
        run SP jobs in arrival order, and NATS keeps this publisher's order per subscriber."""
        assert self.bus is not None
        state = self.core.state
        decode = state.instances[a.decode_instance].info
        kvstore = state.instances.get(a.kvstore_instance)
        chunks, ranks = [], {}
        if not a.in_one_engine:
            chunks = [
                SPChunkSpec(start=c.start, end=c.end, members=list(c.instances), layout=c.layout) for c in a.chunks
            ]
            ranks = {i: state.instances[i].info.rank for i in a.prefill_instances}
        msg = RunPrefillMsg(
            request=a.spec,
            decode_instance=a.decode_instance,
            decode_rank=decode.rank,
            kvstore_instance=a.kvstore_instance,
            kvstore_rank=kvstore.info.rank if kvstore else -1,
            chunks=chunks,
            ranks=ranks,
            csa_drop=a.csa_drop,
            csa_levels=a.csa_levels,
            csa_rule=a.csa_rule,
        )
        async with self._plan_lock:  # another admission's plan must not interleave with this one's commands
            if decode.kvp_group:  # a KV-parallel group: its leader learns the placement before any KV arrives
                place = PlaceKVP(request_id=a.spec.request_id, shards=shard_specs(a.decode_holders))
                await self.bus.publish(subjects.decode_place(decode.kvp_group), place)
            for instance in a.prefill_instances:
                await self.bus.publish(subjects.prefill_run(instance), msg)

    async def _run_batch(self, a: RunBatch) -> None:
        """Send the iteration to every member of its group, before any later command (their order is the plan's)."""
        assert self.bus is not None
        state = self.core.state
        msg = RunIteration(
            batch_id=a.batch_id,
            members=list(a.instances),
            ranks={i: state.instances[i].info.rank for i in a.instances if i in state.instances},
            prefills=[
                IterationPrefill(
                    request=p.spec, start=p.start, end=p.end, retain=shard_specs(p.retain), master=p.master
                )
                for p in a.prefills
            ],
            decodes=[IterationDecode(request_id=d.request_id, master=d.master) for d in a.decodes],
            offload=a.offload,
        )
        async with self._plan_lock:
            for instance in a.instances:
                await self.bus.publish(subjects.elastic_iteration(instance), msg)

    async def _migrate(self, a: MigrateKV) -> None:
        """Tell the destination; it asks the source for the KV and reports KVMigrated (or the request fails)."""
        assert self.bus is not None
        src = self.core.state.instances.get(a.src)
        if src is None:  # gone meanwhile: its loss fails the request
            log.warning("migration of %s from %s: the source is not registered", a.request_id, a.src)
            return
        msg = MigrateKVIn(request_id=a.request_id, src=a.src, src_rank=src.info.rank)
        async with self._plan_lock:  # after the iterations already sent to the destination
            await self.bus.publish(subjects.elastic_migrate_in(a.dst), msg)

    async def _preempt(self, a: Preempt) -> None:
        assert self.bus is not None
        kvstore = self.core.state.instances.get(a.kvstore_instance)
        try:
            if kvstore is None or not kvstore.alive:
                raise RuntimeError(f"kvstore {a.kvstore_instance} is not live")
            reply = await self.bus.request(
                subjects.decode_preempt(a.instance),
                PreemptDecode(
                    request_id=a.request_id, kvstore_instance=a.kvstore_instance, kvstore_rank=kvstore.info.rank
                ),
                PreemptReply,
                timeout=PREEMPT_TIMEOUT_S,
            )
        except Exception as e:  # a timeout or a dead instance: the request keeps running, or the loss fails it
            self.core.preempt_refused(a.request_id, f"{type(e).__name__}: {e}")
            return
        if not reply.accepted:
            self.core.preempt_refused(a.request_id, reply.reason)

    async def _move_parked(self, a: TransferKV) -> None:
        assert self.bus is not None
        try:
            reply = await self.bus.request(
                subjects.decode_move(a.src), MoveParked(request_id=a.request_id, dst_instance=a.dst), MoveReply
            )
        except Exception as e:  # the source died or is stuck: its loss fails the request
            self.core.move_refused(a.request_id, f"{type(e).__name__}: {e}")
            return
        if reply.accepted:
            self.core.moved(a.request_id, a.dst)
        else:
            self.core.move_refused(a.request_id, reply.reason)

    async def _scale_down(self, a: ScaleDownAction) -> None:
        assert self.bus is not None
        member = self.core.state.instances.get(a.instance)
        leader = member.info.kvp_group if member is not None else ""
        try:
            if not leader:
                raise RuntimeError(f"{a.instance} is not a member of a KV-parallel group")
            reply = await self.bus.request(
                subjects.decode_scale_down(leader),
                ScaleDownKVP(request_id=a.request_id, instance=a.instance, into=a.into),
                ScaleDownReply,
            )
        except Exception as e:  # the leader died or is stuck: its loss fails the request
            self.core.scale_down_refused(a.request_id, f"{type(e).__name__}: {e}", time.time())
            return
        if reply.accepted:
            self.core.scaled_down(a.request_id, a.instance, a.into)
        else:
            self.core.scale_down_refused(a.request_id, reply.reason, time.time())

    async def _publish_decisions(self, actions: list[Action]) -> None:
        """What the strategy decided, for watchers (the gateway's /dashboard): one small message per action."""
        assert self.bus is not None
        now = time.time()
        for a in actions:
            if (d := decision(a, self.strategy_name, now)) is not None:
                await self.bus.publish(subjects.DECISIONS, d)

    async def _execute(self, actions: list[Action]) -> None:
        assert self.bus is not None
        if actions and log.isEnabledFor(logging.DEBUG):
            log.debug("actions: %s", "; ".join(map(repr, actions)))
        await self._publish_decisions(actions)
        for a in actions:
            if isinstance(a, RunPrefill):
                await self._run_prefill(a)
            elif isinstance(a, RunBatch):
                await self._run_batch(a)
            elif isinstance(a, MigrateKV):
                await self._migrate(a)
            elif isinstance(a, Reshard):
                log.info("re-sharding %s to %s", a.instance, a.to)
                async with self._plan_lock:  # in order with the iterations sent to it
                    await self.bus.publish(subjects.elastic_reshard(a.instance), ReshardInstance(to=a.to))
            elif isinstance(a, Preempt):
                self._spawn(self._preempt(a))  # its reply must not hold up the tick loop
            elif isinstance(a, TransferKV):
                self._spawn(self._move_parked(a))
            elif isinstance(a, ScaleDownAction):
                self._spawn(self._scale_down(a))
            elif isinstance(a, FailRequest):
                log.warning("failing %s: %s", a.request_id, a.message)
                await self.bus.publish(
                    subjects.stream(a.request_id),
                    StreamEvent(request_id=a.request_id, seq=0, error=a.message, status=a.status),
                )
                await self.bus.publish(subjects.ABORT, Abort(request_id=a.request_id, reason=a.message))
            else:
                raise AssertionError(f"unexpected action {a!r}")
