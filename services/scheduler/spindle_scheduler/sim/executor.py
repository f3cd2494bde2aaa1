"""The simulated executor: drives the real `SchedulerCore` and strategy with a virtual clock.

It plays the part service.py plays against NATS: heartbeats and worker events go into the core, the core's
actions (RunPrefill, FailRequest, Reject) are carried out on simulated instances. Lifecycle of a request:
arrival -> core.admit -> FCFS queue on its prefill instance -> prefill (first token) -> KV transfer ->
wait (parked, FIFO) for decode blocks -> continuous-batching decode steps -> finished, blocks freed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from spindle_protocol.messages import (
    DecodeStarted,
    PrefillDone,
    Prompt,
    RequestFinished,
    RequestSpec,
    Sampling,
    TransferDone,
    WorkerEvent,
)

from ..actions import Action, Admit, FailRequest, Reject, RunPrefill
from ..core import SchedulerCore
from ..latency import LatencyModel
from ..strategy import Strategy, create_strategy
from ..workloads import TraceRequest
from .cluster import SimConfig, SimDecode, SimInstance, SimPrefill
from .events import EventKind, EventQueue
from .metrics import RequestRecord, SimSummary, summarize


@dataclass
class SimResult:
    strategy: str
    records: list[RequestRecord]
    peak_kv_blocks: dict[str, tuple[int, int]]  # instance id -> (peak blocks used, total blocks)
    events: int  # events processed
    end_time: float  # virtual time of the last event
    wall_s: float

    def summary(self, workload: str = "", rate: float | None = None) -> SimSummary:
        return summarize(self.records, self.strategy, workload, rate)


class Simulator:
    """One simulated run. Prefill time is `latency.prefill` at SP 1 with no history; decode steps use
    `latency.decode` at (tp 1, kvp 1), or `config.decode_step_s` when it is absent; transfers use
    `latency.transfer` (instant when absent)."""

    def __init__(self, strategy: Strategy | str, latency: LatencyModel, config: SimConfig | None = None) -> None:
        if latency.prefill is None or 1 not in latency.prefill.coeffs:
            raise ValueError("the simulator needs a prefill latency model for SP size 1")
        if latency.decode is not None and (1, 1) not in latency.decode.coeffs:
            raise ValueError("the decode latency model has no (tp=1, kvp=1) configuration")
        self.config = cfg = config or SimConfig()
        self.latency = latency
        self.core = SchedulerCore(create_strategy(strategy) if isinstance(strategy, str) else strategy, cfg.scheduler)
        ctx = cfg.context_len()
        self.prefills = [
            SimPrefill(f"prefill-{i}", "prefill", 1 + i, cfg.prefill_kv_blocks, cfg.block_size, ctx)
            for i in range(cfg.num_prefill)
        ]
        self.decodes = [
            SimDecode(f"decode-{j}", "decode", 1 + cfg.num_prefill + j, cfg.decode_kv_blocks, cfg.block_size, ctx)
            for j in range(cfg.num_decode)
        ]
        # the kvstore only appears in the registry: parked KV waits in decode FIFOs, its memory is not modelled
        kvstore = [SimInstance("kvstore-0", "kvstore", 0, 0, cfg.block_size, 0)] if cfg.with_kvstore else []
        self.instances: dict[str, SimInstance] = {i.id: i for i in [*kvstore, *self.prefills, *self.decodes]}
        self.queue = EventQueue()
        self.records: dict[str, RequestRecord] = {}
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
            rec = RequestRecord(f"req-{i}", req.arrived_at, req.num_prefill_tokens, req.num_decode_tokens)
            self.records[rec.request_id] = rec
            q.push(req.arrived_at, EventKind.ARRIVAL, rec)
        self._remaining = len(trace)
        handlers = {
            EventKind.HEARTBEAT: self._on_heartbeat,
            EventKind.TICK: self._on_tick,
            EventKind.ARRIVAL: self._on_arrival,
            EventKind.PREFILL_DONE: self._on_prefill_done,
            EventKind.TRANSFER_DONE: self._on_transfer_done,
            EventKind.DECODE_STEP: self._on_decode_step,
        }
        events = 0
        while q:
            now, kind, payload = q.pop()
            handlers[kind](now, payload)
            events += 1
        assert self._remaining == 0, f"{self._remaining} requests never reached a terminal state"
        return SimResult(
            strategy=self.core.strategy.name,
            records=list(self.records.values()),
            peak_kv_blocks={i.id: (i.peak_blocks, i.total_blocks) for i in self.instances.values()},
            events=events,
            end_time=q.now,
            wall_s=time.perf_counter() - started,
        )

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
            elif not isinstance(a, Admit):  # Admit only answers the gateway; RunPrefill carries the placement
                raise AssertionError(f"unexpected action {a!r}")

    def _end(self, rec: RequestRecord, state: str, now: float, reason: str = "") -> None:
        assert rec.state == "pending", f"{rec.request_id} ended twice ({rec.state}, then {state})"
        rec.state, rec.reason = state, reason
        if state == "finished":
            rec.finished_at = now
        self._remaining -= 1

    # ---- arrival and prefill ----

    def _on_arrival(self, now: float, rec: RequestRecord) -> None:
        spec = RequestSpec(
            request_id=rec.request_id,
            prompt=Prompt(num_tokens=rec.num_prefill_tokens),
            sampling=Sampling(max_tokens=rec.num_decode_tokens, ignore_eos=True),
            arrival_time=now,
            deadline=math.inf,
        )
        self._execute(self.core.admit(spec, now), now)

    def _run_prefill(self, a: RunPrefill, now: float) -> None:
        rec = self.records[a.spec.request_id]
        prefill, decode = self.instances[a.prefill_instance], self.instances[a.decode_instance]
        assert isinstance(prefill, SimPrefill) and isinstance(decode, SimDecode), f"bad placement {a}"
        rec.prefill_instance, rec.decode_instance = prefill.id, decode.id
        prefill.queue.append(rec)
        prefill.queued_tokens += rec.num_prefill_tokens
        self._start_prefill(prefill, now)

    def _start_prefill(self, p: SimPrefill, now: float) -> None:
        while p.running is None and p.queue:
            head = p.queue[0]
            if head.state != "pending":  # failed while queued
                p.queue.popleft()
                p.queued_tokens -= head.num_prefill_tokens
                continue
            blocks = self.config.blocks(head.num_prefill_tokens)
            if p.free_blocks < blocks:
                return  # earlier prompts' KV is still being transferred out
            p.queue.popleft()
            p.alloc(head.request_id, blocks)
            p.running = head
            head.prefill_start = now
            seconds = self.latency.prefill.predict(1, 0, head.num_prefill_tokens)  # type: ignore[union-attr]
            self.queue.push(now + seconds, EventKind.PREFILL_DONE, (p, head))

    def _on_prefill_done(self, now: float, payload: tuple[SimPrefill, RequestRecord]) -> None:
        p, rec = payload
        assert p.running is rec
        p.running = None
        p.queued_tokens -= rec.num_prefill_tokens
        rec.prefill_end = now  # the instance was busy until now even if the request failed meanwhile
        if rec.state != "pending":
            p.free(rec.request_id)
        else:
            rec.token_times.append(now)
            finished = rec.num_decode_tokens <= 1
            self._emit(
                PrefillDone(
                    request_id=rec.request_id, instance_id=p.id, seconds=now - rec.prefill_start, finished=finished
                ),
                now,
            )
            if finished:
                p.free(rec.request_id)
                self._end(rec, "finished", now)
            elif rec.state == "pending":
                nbytes = rec.num_prefill_tokens * self.config.kv_bytes_per_token
                seconds = self.latency.transfer.predict(nbytes) if self.latency.transfer else 0.0
                self.queue.push(now + seconds, EventKind.TRANSFER_DONE, rec)
            else:
                p.free(rec.request_id)
        self._start_prefill(p, now)

    # ---- transfer and decode ----

    def _on_transfer_done(self, now: float, rec: RequestRecord) -> None:
        p = self.instances[rec.prefill_instance]
        assert isinstance(p, SimPrefill)
        p.free(rec.request_id)
        self._start_prefill(p, now)
        if rec.state != "pending":
            return
        d = self.instances[rec.decode_instance]
        assert isinstance(d, SimDecode)
        rec.transfer_end = now
        parked = bool(d.waiting) or d.free_blocks < self._decode_blocks(rec)
        nbytes = rec.num_prefill_tokens * self.config.kv_bytes_per_token
        self._emit(
            TransferDone(
                request_id=rec.request_id,
                src_instance=p.id,
                dst_instance=d.id,
                nbytes=nbytes,
                seconds=now - (rec.prefill_end or now),
                parked=parked,
            ),
            now,
        )
        if rec.state == "pending":
            d.waiting.append(rec)
            self._join_decode(d, now)
            self._start_step(d, now)

    def _decode_blocks(self, rec: RequestRecord) -> int:
        # blocks for the whole sequence are taken at join, so a running batch never needs preemption
        return self.config.blocks(rec.num_prefill_tokens + rec.num_decode_tokens)

    def _join_decode(self, d: SimDecode, now: float) -> None:
        while d.waiting:
            head = d.waiting[0]
            if head.state != "pending":
                d.waiting.popleft()
                continue
            blocks = self._decode_blocks(head)
            if d.free_blocks < blocks:
                return
            d.waiting.popleft()
            d.alloc(head.request_id, blocks)
            d.running.append(head)
            d.kv_tokens += head.num_prefill_tokens + len(head.token_times)
            head.decode_start = now
            self._emit(DecodeStarted(request_id=head.request_id, instance_id=d.id), now)

    def _start_step(self, d: SimDecode, now: float) -> None:
        if d.stepping or not d.running:
            return
        d.stepping = True
        model = self.latency.decode
        seconds = model.predict(len(d.running), d.kv_tokens) if model else self.config.decode_step_s
        self.queue.push(now + seconds, EventKind.DECODE_STEP, d)

    def _on_decode_step(self, now: float, d: SimDecode) -> None:
        d.stepping = False
        d.kv_tokens += len(d.running)
        still, done = [], []
        for r in d.running:
            r.token_times.append(now)
            (done if len(r.token_times) >= r.num_decode_tokens else still).append(r)
        d.running = still
        for r in done:
            self._leave_decode(d, r)
            self._end(r, "finished", now)
            self._emit(
                RequestFinished(
                    request_id=r.request_id,
                    instance_id=d.id,
                    finish_reason="length",
                    num_output_tokens=len(r.token_times),
                ),
                now,
            )
        self._join_decode(d, now)
        self._start_step(d, now)

    def _leave_decode(self, d: SimDecode, rec: RequestRecord) -> None:
        d.free(rec.request_id)
        d.kv_tokens -= rec.num_prefill_tokens + len(rec.token_times)

    def _fail(self, rec: RequestRecord, now: float, reason: str) -> None:
        """Abort everywhere: queued/transferring work is dropped when reached; a decode slot is freed now."""
        if rec.state != "pending":
            return
        self._end(rec, "failed", now, reason)
        d = self.instances.get(rec.decode_instance)
        if isinstance(d, SimDecode) and rec in d.running:
            d.running.remove(rec)
            self._leave_decode(d, rec)
            self._join_decode(d, now)
            self._start_step(d, now)


def simulate(
    trace: Sequence[TraceRequest],
    strategy: Strategy | str,
    latency: LatencyModel,
    config: SimConfig | None = None,
) -> SimResult:
    return Simulator(strategy, latency, config).run(trace)
