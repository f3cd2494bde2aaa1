"""The simulated executor: drives the real `SchedulerCore` and strategy with a virtual clock.

It plays the part service.py plays against NATS: heartbeats and worker events go into the core, the core's
actions (RunPrefill, FailRequest, Reject) are carried out on simulated instances.

Disaggregated lifecycle: arrival -> core.admit -> the plan's chunks queue FCFS on their SP groups -> each
chunk runs when its whole group is free (first token after the last chunk) -> KV transfer from every holder
in parallel -> wait (parked, FIFO) for decode blocks -> continuous-batching decode steps -> finished. A
`Preempt` swaps a decoding request's KV out to the kvstore and queues it again; it resumes (after the KV
comes back) when its blocks are free.
Colocated lifecycle (plan and decode on one elastic instance): the instance batches as the engine does, its
decodes and pieces of several prompts per step under a token budget (colocated_side.py); the KV never moves.
Per-iteration lifecycle (an `elastic` strategy, LoongServe): arrival -> Admit without placement -> the
strategy sends each group of colocated instances its next iteration (RunBatch) as the last one ends
(iteration_side.py).

Re-sharding lifecycle (a `reshards` strategy, Seesaw): as per-iteration, on groups that switch parallel
configuration (`Reshard`), prefill iterations that offload prompts to the kvstore's host tier and onboarding back
(`MigrateKV` from the kvstore) before decode iterations (tier_side.py).

Every single-instance iteration is priced by what it holds, whichever strategy sent it (prices.py).

This file holds the loop, arrivals and failures; the prefill side is in prefill_side.py, the decode side in
decode_side.py, colocated batching in colocated_side.py, preemption and moves of parked requests in swaps.py,
re-sharding in tier_side.py (mixins over the state in base.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    ScaleDownKVP,
    TransferKV,
)
from spindle_policy.core import SchedulerConfig, SchedulerCore
from spindle_policy.latency import LatencyModel
from spindle_policy.strategy import Strategy, create_strategy
from spindle_protocol.messages import (
    Prompt,
    RequestSpec,
    Sampling,
    WorkerEvent,
)

from .cluster import ChunkJob, SimColocated, SimConfig, SimDecode, SimInstance, SimPrefill, pack_nodes
from .colocated_side import ColocatedSide
from .decode_side import DecodeSide
from .events import EventKind, EventQueue
from .iteration_side import IterationSide
from .metrics import RequestRecord, SimSummary, Slo, summarize
from .prefill_side import PrefillSide
from .prices import ErrorStats, FittedPrices, JudgedPrices
from .swaps import Swaps
from .tier_side import TierSide
from .workloads import TraceRequest

PERIODIC = (EventKind.HEARTBEAT, EventKind.TICK)
# virtual seconds with nothing queued but heartbeats and ticks, and requests not ended, that count as a stall (a
# strategy's own timers act on ticks well within it)
STALL_S = 3600.0


@dataclass
class SimResult:
    strategy: str
    records: list[RequestRecord]
    peak_kv_blocks: dict[str, tuple[int, int]]  # instance id -> (peak blocks used, total blocks)
    events: int  # events processed
    end_time: float  # virtual time of the last event
    wall_s: float
    plan_ns: list[int] = field(default_factory=list)  # wall time of each call of the strategy's plan()
    tier: dict[str, float] = field(default_factory=dict)  # re-shards and host-tier swaps (tier_side.py)
    # how far the strategy's forms were from what the work was charged, per kind of work (prices.JudgedPrices);
    # empty where the run is priced by the strategy's own forms
    prediction_error: dict[str, dict[str, float | int]] = field(default_factory=dict)

    def summary(self, workload: str = "", rate: float | None = None, slo: Slo | None = None) -> SimSummary:
        s = summarize(self.records, self.strategy, workload, rate, slo, self.plan_ns)
        return replace(s, prediction_error=self.prediction_error or None)


class TimedCore(SchedulerCore):
    """The core, with the wall time of each call of the strategy's `plan()` noted in `plan_ns` (the core's
    `plan` seam: the timing stays out of the pure core)."""

    def __init__(self, strategy: Strategy, config: SchedulerConfig | None = None) -> None:
        super().__init__(strategy, config)
        self.plan_ns: list[int] = []

    def plan(self, spec: RequestSpec, now: float) -> list[Action]:
        started = time.perf_counter_ns()
        try:
            return super().plan(spec, now)
        finally:
            self.plan_ns.append(time.perf_counter_ns() - started)


class Simulator(PrefillSide, DecodeSide, ColocatedSide, Swaps, IterationSide, TierSide):
    """One simulated run. Every piece of work is charged by `prices` (prices.py): on a named cluster the cost model
    itself, while the strategy plans with the forms fitted to it (`latency`), and the run reports how far they were
    apart (`SimResult.prediction_error`); elsewhere the forms of `latency` themselves. Transfers from every source
    instance run in parallel, each on the link it crosses."""

    def __init__(self, strategy: Strategy | str, latency: LatencyModel, config: SimConfig | None = None) -> None:
        self.config = cfg = config or SimConfig()
        if latency.prefill is None or 1 not in latency.prefill.coeffs:
            raise ValueError("the simulator needs a prefill latency model for SP size 1")
        if latency.decode is not None:
            need = [(cfg.decode_tp, 1)] if cfg.num_decode else []
            need += [(cfg.colocated_tp, 1)] if cfg.num_colocated else []
            if missing := [k for k in need if k not in latency.decode.coeffs]:
                raise ValueError(f"the decode latency model has no (tp, kvp) = {missing[0]} configuration")
        self.latency = latency
        strategy = create_strategy(strategy, latency) if isinstance(strategy, str) else strategy
        if strategy.reshards and latency.reshard is None:
            raise ValueError(
                f"{strategy.name}'s groups are priced by the cost model: simulate a named cluster (--hardware)"
            )
        self.core = TimedCore(strategy, cfg.scheduler)
        # what work costs (prices.py), and what the strategy's own forms say it costs, where the two differ
        self.prices = FittedPrices(latency, cfg.decode_step_s)
        if latency.ground_truth is not None:  # the strategy's forms predict, the ground truth charges
            self.prices = JudgedPrices(latency.ground_truth, self.prices)
        self.step_budget = strategy.step_token_budget
        ctx, bs = cfg.context_len(), cfg.block_size
        n_p, n_d, tp_c = cfg.num_prefill, cfg.num_decode, cfg.colocated_tp
        prefills = [
            SimPrefill(f"prefill-{i}", "prefill", 1 + i, cfg.prefill_kv_blocks, bs, ctx, tp=cfg.prefill_tp)
            for i in range(n_p)
        ]
        decodes = [
            SimDecode(f"decode-{j}", "decode", 1 + n_p + j, cfg.decode_kv_blocks, bs, ctx, tp=cfg.decode_tp)
            for j in range(n_d)
        ]
        colocated = [
            SimColocated(
                f"elastic-{k}",
                "elastic",
                1 + n_p + n_d + k,
                cfg.decode_kv_blocks,
                bs,
                ctx,
                tp=tp_c,
                spp=cfg.colocated_spp,
            )
            for k in range(cfg.num_colocated)
        ]
        if latency.reshard is not None:  # re-sharding groups start in the prefill configuration
            start = latency.reshard.config(latency.reshard.prefill)
            for c in colocated:
                c.parallel, c.spp = start.label, start.pp
        ordered: list[SimInstance] = [*prefills, *decodes, *colocated]
        for inst, node in zip(ordered, pack_nodes(cfg.instance_widths(), cfg.gpus_per_node), strict=True):
            inst.node = f"node-{node}"  # an instance never straddles two nodes
            inst.kv_bytes_per_token = cfg.kv_bytes_per_token
        # the kvstore only appears in the registry: parked KV waits in decode FIFOs, its memory is not modelled
        kvstore = [SimInstance("kvstore-0", "kvstore", 0, cfg.host_kv_blocks, bs, 0)] if cfg.with_kvstore else []
        self.instances: dict[str, SimInstance] = {i.id: i for i in [*kvstore, *prefills, *decodes, *colocated]}
        self.queue = EventQueue()
        self.records: dict[str, RequestRecord] = {}
        self.plans: dict[str, RunPrefill] = {}
        self._next_chunk: dict[str, int] = {}  # request id -> index of its next chunk to run
        self._running: set[str] = set()  # requests with a chunk executing now
        self._swapped: set[str] = set()  # preempted requests whose KV is in the kvstore
        self._split_masters: set[SimDecode] = set()  # masters whose queue head waits for blocks elsewhere
        self._freed: set[SimDecode] = set()  # queues to retry: blocks freed on them by a request mastered elsewhere
        self._tails: dict[str, SimDecode] = {}
        self._scaled_up: dict[str, SimDecode] = {}
        self._elastic_kv: dict[str, dict[str, int]] = {}
        self._in_batch: dict[str, int] = {}
        self._stage_free: dict[str, list[float]] = {}  # sequence-pipeline instance -> when each stage frees up
        self._sampled_by: dict[str, float] = {}
        self._batch_of: dict[str, int] = {}
        self._migrations: dict[str, int] = {}
        self._host_free: dict[str, float] = {}
        self._onboarding: dict[str, tuple[str, float, float]] = {}
        self.tier_stats: dict[str, float] = {}
        self._remaining = 0
        self._ran = False

    # ---- the loop ----

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        assert not self._ran, "a Simulator runs once; make a new one"
        self._ran = True
        started = time.perf_counter()
        q, cfg = self.queue, self.config
        q.push(0.0, EventKind.HEARTBEAT)
        q.push(cfg.tick_s, EventKind.TICK)
        for i, req in enumerate(trace):
            rec = RequestRecord(
                f"req-{i}", req.arrived_at, req.num_prefill_tokens, req.num_decode_tokens, req.service_class
            )
            self.records[rec.request_id] = rec
            q.push(req.arrived_at, EventKind.ARRIVAL, rec)
        self._remaining = len(trace)
        handlers = {
            EventKind.HEARTBEAT: self._on_heartbeat,
            EventKind.TICK: self._on_tick,
            EventKind.ARRIVAL: self._on_arrival,
            EventKind.CHUNK_DONE: self._on_chunk_done,
            EventKind.TRANSFER_DONE: self._on_transfer_done,
            EventKind.DECODE_STEP: self._on_step,
            EventKind.SWAP_OUT_DONE: self._on_swap_out_done,
            EventKind.SWAP_IN_DONE: self._on_swap_in_done,
            EventKind.ITERATION_DONE: self._on_iteration_done,
            EventKind.MIGRATE_DONE: self._on_migrate_done,
            EventKind.OFFLOAD_DONE: self._on_offload_done,
            EventKind.RESHARD_DONE: self._on_reshard_done,
        }
        events, progress_at = 0, 0.0
        while q:
            now, kind, payload = q.pop()
            handlers[kind](now, payload)
            events += 1
            if kind not in PERIODIC or len(q) > len(PERIODIC):
                progress_at = now
            elif now - progress_at > STALL_S:
                stuck = [r.request_id for r in self.records.values() if r.state == "pending"]
                raise RuntimeError(
                    f"the simulation stalled: nothing but heartbeats and ticks for {STALL_S:g} virtual seconds "
                    f"since t={progress_at:.1f}, with {len(stuck)} request(s) not ended: {', '.join(stuck[:8])}"
                )
        assert self._remaining == 0, f"{self._remaining} requests never reached a terminal state"
        return SimResult(
            strategy=self.core.strategy.describe(),
            records=list(self.records.values()),
            peak_kv_blocks={i.id: (i.peak_blocks, i.total_blocks) for i in self.instances.values()},
            events=events,
            # a pipeline's last tokens may be timed after the last event (overlap: sampled when the last stage ends)
            end_time=max([q.now, *(r.finished_at for r in self.records.values() if r.finished_at is not None)]),
            wall_s=time.perf_counter() - started,
            plan_ns=list(self.core.plan_ns),
            tier=dict(self.tier_stats),
            prediction_error=self._prediction_error(),
        )

    def _prediction_error(self) -> dict[str, dict[str, float | int]]:
        """How far the strategy's forms were from the prices charged, per kind of work (on a judged cluster), and
        its plans' predicted TTFT from the TTFT each request got ("ttft", over the finished requests it predicted)."""
        out = self.prices.report() if isinstance(self.prices, JudgedPrices) else {}
        ttft = ErrorStats()
        for r in self.records.values():
            if r.predicted_ttft is not None and r.state == "finished" and (got := r.ttft) is not None:
                ttft.add(got, r.predicted_ttft)
        if ttft.count:
            out["ttft"] = ttft.as_dict()
        return out

    def _periodic(self, now: float, kind: EventKind, every: float) -> None:
        if self._remaining > 0:
            self.queue.push(now + every, kind)

    def _on_heartbeat(self, now: float, _: object) -> None:
        for inst in self.instances.values():
            self.core.on_heartbeat(inst.info(now))
        self._periodic(now, EventKind.HEARTBEAT, self.config.heartbeat_s)

    def _on_tick(self, now: float, _: object) -> None:
        self._execute(self.core.tick(now), now)
        self._periodic(now, EventKind.TICK, self.config.tick_s)

    def _emit(self, event: WorkerEvent, now: float) -> None:
        self._execute(self.core.on_event(event, now), now)

    def _execute(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, RunPrefill):
                self._run_prefill(a, now)
            elif isinstance(a, Reject):
                self._end(self.records[a.request_id], "rejected", now, f"{a.status}: {a.reason}")
            elif isinstance(a, FailRequest):
                self._fail(self.records[a.request_id], now, f"{a.status}: {a.message}")
            elif isinstance(a, Preempt):
                self._preempt(a, now)
            elif isinstance(a, TransferKV):
                self._move_parked(a, now)
            elif isinstance(a, ScaleDownKVP):
                self._scale_down(a, now)
            elif isinstance(a, RunBatch):
                self._run_batch(a, now)
            elif isinstance(a, MigrateKV):
                self._migrate(a, now)
            elif isinstance(a, Reshard):
                self._reshard(a.instance, a.to, now)
            elif isinstance(a, Admit):  # it answers the gateway; RunPrefill carries the placement
                if a.predicted_ttft_s is not None and a.request_id in self.records:
                    self.records[a.request_id].predicted_ttft = a.predicted_ttft_s
            else:
                raise AssertionError(f"unexpected action {a!r}")

    def _end(self, rec: RequestRecord, state: str, now: float, reason: str = "") -> None:
        assert rec.state == "pending", f"{rec.request_id} ended twice ({rec.state}, then {state})"
        rec.state, rec.reason = state, reason
        if state == "finished":
            rec.finished_at = now
        self._remaining -= 1

    # ---- arrival and placement ----

    def _on_arrival(self, now: float, rec: RequestRecord) -> None:
        spec = RequestSpec(
            request_id=rec.request_id,
            prompt=Prompt(num_tokens=rec.num_prefill_tokens),
            sampling=Sampling(max_tokens=rec.num_decode_tokens, ignore_eos=True),
            arrival_time=now,
            deadline=math.inf,
            service_class=rec.service_class,  # type: ignore[arg-type]  # TraceRequest checked it
        )
        self._execute(self.core.admit(spec, now), now)

    def _run_prefill(self, a: RunPrefill, now: float) -> None:
        rec = self.records[a.spec.request_id]
        if rec.state != "pending":  # a FailRequest came first
            return
        dst = self.instances.get(a.decode_instance)
        members = [self.instances.get(i) for i in a.prefill_instances]
        rec.prefill_instance, rec.prefill_instances = a.chunks[0].instances[0], a.prefill_instances
        rec.decode_instance, rec.max_sp = a.decode_instance, max(c.sp for c in a.chunks)
        self.plans[rec.request_id] = a
        self._next_chunk[rec.request_id] = 0
        if isinstance(dst, SimColocated):
            assert all(m is dst for m in members), f"a colocated plan runs on its decode instance: {a}"
            self._queue_prompt(dst, rec)
            self._start_step(dst, now)
            return
        jobs = [ChunkJob(rec, a, i) for i in range(len(a.chunks))]
        assert isinstance(dst, SimDecode) and all(isinstance(m, SimPrefill) for m in members), f"bad placement {a}"
        holders = [self.instances.get(h.instance) for h in a.decode_holders]
        assert all(isinstance(h, SimDecode) and not isinstance(h, SimColocated) for h in holders), f"bad shards {a}"
        for job in jobs:
            for k, iid in enumerate(job.chunk.instances):
                p = self.instances[iid]
                assert isinstance(p, SimPrefill)
                p.queue.append(job)
                p.queued_tokens += job.chunk.share(k)
        for m in members:
            self._pump(m, now)  # type: ignore[arg-type]

    def _fail(self, rec: RequestRecord, now: float, reason: str) -> None:
        """Abort everywhere: queued work is dropped when reached; held KV is freed now unless a step or
        chunk of the request is executing (then when it ends)."""
        if rec.state != "pending":
            return
        self._end(rec, "failed", now, reason)
        rid = rec.request_id
        if self.core.strategy.elastic:
            self._fail_elastic(rec)
            return
        if rid not in self.plans:
            return
        d = self.instances[rec.decode_instance]
        if isinstance(d, SimColocated):
            if rid in self._running or rec in d.step_batch:
                return  # the step in flight frees it
            self._drop_prompt(d, rec)
            self._leave_decode(d, rec)
            self._start_step(d, now)
            return
        if rid not in self._running:
            self._release_prefill(rec, now)
        assert isinstance(d, SimDecode)
        if rec in d.running:
            if d.stepping:
                return  # leaves at the end of the step in flight
            self._leave_decode(d, rec)
        self._join_decode(d, now)
        self._start_step(d, now)
        self._retry_split_joins(now)


def simulate(
    trace: Sequence[TraceRequest],
    strategy: Strategy | str,
    latency: LatencyModel,
    config: SimConfig | None = None,
) -> SimResult:
    return Simulator(strategy, latency, config).run(trace)
