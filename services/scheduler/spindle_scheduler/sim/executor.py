"""The simulated executor: drives the real `SchedulerCore` and strategy with a virtual clock.

It plays the part service.py plays against NATS: heartbeats and worker events go into the core, the core's
actions (RunPrefill, FailRequest, Reject) are carried out on simulated instances.

Disaggregated lifecycle: arrival -> core.admit -> the plan's chunks queue FCFS on their SP groups -> each
chunk runs when its whole group is free (first token after the last chunk) -> KV transfer from every holder
in parallel -> wait (parked, FIFO) for decode blocks -> continuous-batching decode steps -> finished. A
`Preempt` swaps a decoding request's KV out to the kvstore and queues it again; it resumes (after the KV
comes back) when its blocks are free.
Colocated lifecycle (plan and decode on one elastic instance): chunks are mixed one per step into the
instance's decode batches; the KV never moves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from spindle_protocol.messages import (
    DecodeStarted,
    Preempted,
    PrefillDone,
    PrefillProgress,
    Prompt,
    RequestFinished,
    RequestSpec,
    Sampling,
    TransferDone,
    WorkerEvent,
)

from ..actions import Action, Admit, FailRequest, Preempt, Reject, RunPrefill, TransferKV
from ..core import SchedulerCore
from ..latency import LatencyModel
from ..strategy import Strategy, create_strategy
from ..workloads import TraceRequest
from .cluster import ChunkJob, SimColocated, SimConfig, SimDecode, SimInstance, SimPrefill
from .events import EventKind, EventQueue
from .metrics import RequestRecord, SimSummary, Slo, summarize


@dataclass
class SimResult:
    strategy: str
    records: list[RequestRecord]
    peak_kv_blocks: dict[str, tuple[int, int]]  # instance id -> (peak blocks used, total blocks)
    events: int  # events processed
    end_time: float  # virtual time of the last event
    wall_s: float

    def summary(self, workload: str = "", rate: float | None = None, slo: Slo | None = None) -> SimSummary:
        return summarize(self.records, self.strategy, workload, rate, slo)


def _share(num_tokens: int, sp: int, k: int) -> int:
    """Tokens of a chunk that member `k` of an SP group computes and holds."""
    return num_tokens // sp + (1 if k < num_tokens % sp else 0)


class Simulator:
    """One simulated run. A chunk takes `latency.prefill.predict(sp, start, length)`; decode steps use
    `latency.decode` at (config.decode_tp, 1) — (1, 1) on colocated instances — or `config.decode_step_s`
    when it is absent; a mixed colocated step costs its chunk plus its decodes; transfers use
    `latency.transfer` per source instance, in parallel (instant when absent)."""

    def __init__(self, strategy: Strategy | str, latency: LatencyModel, config: SimConfig | None = None) -> None:
        self.config = cfg = config or SimConfig()
        if latency.prefill is None or 1 not in latency.prefill.coeffs:
            raise ValueError("the simulator needs a prefill latency model for SP size 1")
        if latency.decode is not None:
            need = ([(cfg.decode_tp, 1)] if cfg.num_decode else []) + ([(1, 1)] if cfg.num_colocated else [])
            if missing := [k for k in need if k not in latency.decode.coeffs]:
                raise ValueError(f"the decode latency model has no (tp, kvp) = {missing[0]} configuration")
        self.latency = latency
        self.core = SchedulerCore(
            create_strategy(strategy, latency) if isinstance(strategy, str) else strategy, cfg.scheduler
        )
        ctx, bs = cfg.context_len(), cfg.block_size
        n_p, n_d = cfg.num_prefill, cfg.num_decode
        prefills = [SimPrefill(f"prefill-{i}", "prefill", 1 + i, cfg.prefill_kv_blocks, bs, ctx) for i in range(n_p)]
        decodes = [
            SimDecode(f"decode-{j}", "decode", 1 + n_p + j, cfg.decode_kv_blocks, bs, ctx, tp=cfg.decode_tp)
            for j in range(n_d)
        ]
        colocated = [
            SimColocated(f"elastic-{k}", "elastic", 1 + n_p + n_d + k, cfg.decode_kv_blocks, bs, ctx)
            for k in range(cfg.num_colocated)
        ]
        gpus = 0
        for inst in [*prefills, *decodes, *colocated]:  # pack onto nodes; an instance never straddles two
            width = getattr(inst, "tp", 1)
            if gpus % cfg.gpus_per_node + width > cfg.gpus_per_node:
                gpus += cfg.gpus_per_node - gpus % cfg.gpus_per_node
            inst.node = f"node-{gpus // cfg.gpus_per_node}"
            gpus += width
        # the kvstore only appears in the registry: parked KV waits in decode FIFOs, its memory is not modelled
        kvstore = [SimInstance("kvstore-0", "kvstore", 0, 0, bs, 0)] if cfg.with_kvstore else []
        self.instances: dict[str, SimInstance] = {i.id: i for i in [*kvstore, *prefills, *decodes, *colocated]}
        self.queue = EventQueue()
        self.records: dict[str, RequestRecord] = {}
        self.plans: dict[str, RunPrefill] = {}
        self._next_chunk: dict[str, int] = {}  # request id -> index of its next chunk to run
        self._running: set[str] = set()  # requests with a chunk executing now
        self._swapped: set[str] = set()  # preempted requests whose KV is in the kvstore
        self._split_masters: set[SimDecode] = set()  # masters whose queue head waits for blocks elsewhere
        self._tails: dict[str, SimDecode] = {}
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
            EventKind.CHUNK_DONE: self._on_chunk_done,
            EventKind.TRANSFER_DONE: self._on_transfer_done,
            EventKind.DECODE_STEP: self._on_step,
            EventKind.SWAP_OUT_DONE: self._on_swap_out_done,
            EventKind.SWAP_IN_DONE: self._on_swap_in_done,
        }
        events = 0
        while q:
            now, kind, payload = q.pop()
            handlers[kind](now, payload)
            events += 1
        assert self._remaining == 0, f"{self._remaining} requests never reached a terminal state"
        return SimResult(
            strategy=self.core.strategy.describe(),
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
            elif isinstance(a, Preempt):
                self._preempt(a, now)
            elif isinstance(a, TransferKV):
                self._move_parked(a, now)
            elif not isinstance(a, Admit):  # Admit only answers the gateway; RunPrefill carries the placement
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
        jobs = [ChunkJob(rec, a, i) for i in range(len(a.chunks))]
        if isinstance(dst, SimColocated):
            assert all(m is dst for m in members), f"a colocated plan runs on its decode instance: {a}"
            dst.prefills.extend(jobs)
            dst.queued_tokens += rec.num_prefill_tokens
            self._start_step(dst, now)
            return
        assert isinstance(dst, SimDecode) and all(isinstance(m, SimPrefill) for m in members), f"bad placement {a}"
        holders = [self.instances.get(h.instance) for h in a.decode_holders]
        assert all(isinstance(h, SimDecode) and not isinstance(h, SimColocated) for h in holders), f"bad shards {a}"
        for job in jobs:
            for k, iid in enumerate(job.chunk.instances):
                p = self.instances[iid]
                assert isinstance(p, SimPrefill)
                p.queue.append(job)
                p.queued_tokens += _share(job.chunk.num_tokens, job.chunk.sp, k)
        for m in members:
            self._pump(m, now)  # type: ignore[arg-type]

    # ---- prefill chunks on SP groups ----

    def _pump(self, p: SimPrefill, now: float) -> None:
        """Start the head chunk of `p` if its whole group is ready; drop chunks of ended requests."""
        while p.running is None and p.queue:
            job = p.queue[0]
            if job.rec.state != "pending":
                p.queue.popleft()
                k = job.chunk.instances.index(p.id)
                p.queued_tokens -= _share(job.chunk.num_tokens, job.chunk.sp, k)
                continue
            if self._startable(job):
                self._start_chunk(job, now)
            return

    def _startable(self, job: ChunkJob) -> bool:
        rid, chunk = job.rec.request_id, job.chunk
        if self._next_chunk[rid] != job.index or rid in self._running:
            return False
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill)
            if m.running is not None or not m.queue or m.queue[0] is not job:
                return False
            if m.free_blocks < self.config.blocks(_share(chunk.num_tokens, chunk.sp, k)):
                return False  # earlier prompts' KV is still being transferred out
        return True

    def _start_chunk(self, job: ChunkJob, now: float) -> None:
        rec, chunk = job.rec, job.chunk
        seconds = self.latency.prefill.predict(chunk.sp, chunk.start, chunk.num_tokens)  # type: ignore[union-attr]
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill)
            m.queue.popleft()
            m.running = job
            m.alloc(rec.request_id, self.config.blocks(_share(chunk.num_tokens, chunk.sp, k)))
            m.busy_spans.append((now, now + seconds))
        self._running.add(rec.request_id)
        if job.index == 0:
            rec.prefill_start = now
        self.queue.push(now + seconds, EventKind.CHUNK_DONE, job)

    def _on_chunk_done(self, now: float, job: ChunkJob) -> None:
        rec, chunk, rid = job.rec, job.chunk, job.rec.request_id
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill) and m.running is job
            m.running = None
            m.queued_tokens -= _share(chunk.num_tokens, chunk.sp, k)
        self._running.discard(rid)
        self._next_chunk[rid] = job.index + 1
        if rec.state != "pending":
            self._release_prefill(rec, now)
        elif not job.is_last:
            self._chunk_progress(rec, chunk.instances[0], chunk.end, now)
        else:
            self._prefill_finished(rec, chunk.instances[0], now)
            if rec.state == "pending":
                self.queue.push(now + self._transfer_seconds(rec), EventKind.TRANSFER_DONE, rec)
            else:
                self._release_prefill(rec, now)
        nxt = self.plans[rid].chunks[job.index + 1].instances if not job.is_last else ()
        for iid in dict.fromkeys((*chunk.instances, *nxt)):
            self._pump(self.instances[iid], now)  # type: ignore[arg-type]

    def _chunk_progress(self, rec: RequestRecord, instance_id: str, tokens_done: int, now: float) -> None:
        progress = PrefillProgress(
            request_id=rec.request_id,
            instance_id=instance_id,
            tokens_done=tokens_done,
            tokens_total=rec.num_prefill_tokens,
            chunk_seconds=now - (rec.prefill_start or now),
        )
        self._emit(progress, now)

    def _prefill_finished(self, rec: RequestRecord, instance_id: str, now: float) -> None:
        """The last chunk produced the first token."""
        rec.prefill_end = now
        rec.token_times.append(now)
        finished = rec.num_decode_tokens <= 1
        seconds = now - (rec.prefill_start or now)
        self._emit(
            PrefillDone(request_id=rec.request_id, instance_id=instance_id, seconds=seconds, finished=finished), now
        )
        if finished and rec.state == "pending":
            self._end(rec, "finished", now)

    def _transfer_seconds(self, rec: RequestRecord) -> float:
        if self.latency.transfer is None:
            return 0.0
        holders: dict[str, int] = {}
        for chunk in self.plans[rec.request_id].chunks:
            for k, iid in enumerate(chunk.instances):
                holders[iid] = holders.get(iid, 0) + _share(chunk.num_tokens, chunk.sp, k)
        per_token = self.config.kv_bytes_per_token
        return max(self.latency.transfer.predict(tokens * per_token) for tokens in holders.values())

    def _release_prefill(self, rec: RequestRecord, now: float) -> None:
        """Free the prompt KV `rec` holds on prefill instances (after its transfer, or when it ended)."""
        for iid in self.plans[rec.request_id].prefill_instances:
            p = self.instances[iid]
            p.free(rec.request_id)
            self._pump(p, now)  # type: ignore[arg-type]

    # ---- transfer and decode ----

    def _on_transfer_done(self, now: float, rec: RequestRecord) -> None:
        self._release_prefill(rec, now)
        if rec.state != "pending":
            return
        d = self.instances[rec.decode_instance]
        assert isinstance(d, SimDecode)
        rec.transfer_end = now
        parked = bool(d.waiting) or not self._fits(rec)
        self._emit(
            TransferDone(
                request_id=rec.request_id,
                src_instance=rec.prefill_instance,
                dst_instance=d.id,
                nbytes=rec.num_prefill_tokens * self.config.kv_bytes_per_token,
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

    # ---- KV-parallel decode: a request's KV split over decode instances ----

    def _shards(self, rec: RequestRecord) -> list[tuple[SimDecode, int]]:
        """(instance, tokens it holds now) per decode holder, the master first; the tail holds the outputs."""
        holders = self.plans[rec.request_id].decode_holders
        out = [(self.instances[h.instance], h.end - h.start) for h in holders]
        tail, tokens = out[-1]
        out[-1] = (tail, tokens + len(rec.token_times))
        return out  # type: ignore[return-value]

    def _tail(self, rec: RequestRecord) -> SimDecode:
        """The holder that takes the request's new tokens."""
        tail = self._tails.get(rec.request_id)
        if tail is None:
            tail = self._tails[rec.request_id] = self.instances[self.plans[rec.request_id].decode_holders[-1].instance]
        return tail  # type: ignore[return-value]

    def _shard_blocks(self, rec: RequestRecord) -> list[tuple[SimDecode, int]]:
        """Blocks each holder takes at join: its shard, and on the tail room for every output token too."""
        holders = self._shards(rec)
        tail = len(holders) - 1
        outputs = len(rec.token_times)
        return [
            (inst, self.config.blocks(tokens + (rec.num_decode_tokens - outputs if k == tail else 0)))
            for k, (inst, tokens) in enumerate(holders)
        ]

    def _fits(self, rec: RequestRecord) -> bool:
        return all(inst.free_blocks >= blocks for inst, blocks in self._shard_blocks(rec))

    def _add_kv(self, rec: RequestRecord, sign: int) -> None:
        for inst, tokens in self._shards(rec):
            inst.kv_tokens += sign * tokens

    def _free_decode(self, rec: RequestRecord) -> None:
        for inst, _ in self._shards(rec):
            inst.free(rec.request_id)

    def _retry_split_joins(self, now: float) -> None:
        """A split request heading a master's queue may wait for blocks on another instance: retry them all."""
        for d in list(self._split_masters):
            self._join_decode(d, now)
            self._start_step(d, now)

    def _join_decode(self, d: SimDecode, now: float) -> None:
        while d.waiting:
            head = d.waiting[0]
            if head.state != "pending":
                d.waiting.popleft()
                continue
            if not self._fits(head):
                if self.plans[head.request_id].decode_shards:
                    self._split_masters.add(d)
                return
            self._split_masters.discard(d)
            d.waiting.popleft()
            for inst, blocks in self._shard_blocks(head):
                inst.alloc(head.request_id, blocks)
            if head.request_id in self._swapped:  # its KV comes back from the kvstore first
                self._swapped.discard(head.request_id)
                self.queue.push(now + self._kv_seconds(self._context(head)), EventKind.SWAP_IN_DONE, (d, head))
            else:
                self._start_decoding(d, head, now)

    def _start_decoding(self, d: SimDecode, rec: RequestRecord, now: float) -> None:
        d.running.append(rec)
        self._add_kv(rec, +1)
        rec.decode_start = now
        self._emit(DecodeStarted(request_id=rec.request_id, instance_id=d.id), now)

    def _start_step(self, d: SimDecode, now: float) -> None:
        if d.stepping:
            return
        chunk = self._next_colocated_chunk(d, now) if isinstance(d, SimColocated) else None
        if not d.running and chunk is None:
            return
        seconds = 0.0
        if d.running:
            seconds = self._decode_step_seconds(d)
        if chunk is not None:
            assert isinstance(d, SimColocated)
            c = chunk.chunk
            chunk_s = self.latency.prefill.predict(1, c.start, c.num_tokens)  # type: ignore[union-attr]
            d.busy_spans.append((now, now + chunk_s))
            seconds += chunk_s
            d.step_chunk = chunk
            self._running.add(chunk.rec.request_id)
        d.stepping = True
        if isinstance(d, SimColocated):
            d.step_batch = list(d.running)
        self.queue.push(now + seconds, EventKind.DECODE_STEP, d)

    def _decode_step_seconds(self, d: SimDecode) -> float:
        """The step of `d`'s batch over its local KV; with split requests in the batch, the step also waits
        for the other holders' partial attention over their shards (run in parallel: the slowest counts)."""
        model = self.latency.decode
        if model is None:
            return self.config.decode_step_s
        seconds = model.predict(len(d.running), d.kv_tokens, tp=d.tp)
        remote: dict[str, tuple[int, int]] = {}  # holder -> (split requests of this batch, their tokens there)
        for r in d.running:
            if self.plans[r.request_id].decode_shards:
                for inst, tokens in self._shards(r):
                    if inst is not d:
                        n, t = remote.get(inst.id, (0, 0))
                        remote[inst.id] = (n + 1, t + tokens)
        for n, tokens in remote.values():
            seconds = max(seconds, model.predict(n, tokens, tp=d.tp))
        return seconds

    def _next_colocated_chunk(self, c: SimColocated, now: float) -> ChunkJob | None:
        """Pop the head prefill chunk if it can run now (its request's whole-sequence blocks fit)."""
        while c.prefills:
            job = c.prefills[0]
            rid = job.rec.request_id
            if job.rec.state != "pending":
                c.prefills.popleft()
                c.queued_tokens -= job.chunk.num_tokens
                continue
            if job.index == 0:
                blocks = self._decode_blocks(job.rec)
                if c.free_blocks < blocks:
                    return None  # FCFS: wait for running requests to finish
                c.alloc(rid, blocks)
                job.rec.prefill_start = now
            return c.prefills.popleft()
        return None

    def _on_step(self, now: float, d: SimDecode) -> None:
        d.stepping = False
        colocated = isinstance(d, SimColocated)
        batch = d.step_batch if colocated else d.running
        ended = []
        for r in batch:
            if r.state != "pending":  # failed during the step
                ended.append(r)
                continue
            times = r.token_times
            times.append(now)
            self._tail(r).kv_tokens += 1  # the new token's KV lands on the tail holder
            if len(times) >= r.num_decode_tokens:
                ended.append(r)
        finished = []
        for r in ended:
            if r.state == "pending":
                finished.append(r)
            self._leave_decode(d, r)
        for r in finished:
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
        if colocated and d.step_chunk is not None:
            self._colocated_chunk_done(d, d.step_chunk, now)
        if colocated:
            d.step_batch = []
        else:
            for rid in d.preempt_after_step:
                r = self.records[rid]
                if r.state == "pending" and r in d.running:
                    self._swap_out(d, r, now)
                else:
                    self.core.preempt_refused(rid, "it ended before the step did")
            d.preempt_after_step.clear()
            self._join_decode(d, now)
        self._start_step(d, now)
        if ended and self._split_masters:
            self._retry_split_joins(now)

    def _colocated_chunk_done(self, c: SimColocated, job: ChunkJob, now: float) -> None:
        rec, rid = job.rec, job.rec.request_id
        c.step_chunk = None
        c.queued_tokens -= job.chunk.num_tokens
        self._running.discard(rid)
        self._next_chunk[rid] = job.index + 1
        if rec.state != "pending":
            c.free(rid)
        elif not job.is_last:
            self._chunk_progress(rec, c.id, job.chunk.end, now)
        else:
            self._prefill_finished(rec, c.id, now)
            if rec.state == "pending":
                rec.transfer_end = now  # the KV is already where it decodes
                self._start_decoding(c, rec, now)
            else:
                c.free(rid)

    # ---- moving a parked request to another decode instance ----

    def _move_parked(self, a: TransferKV, now: float) -> None:
        rec, src, dst = self.records[a.request_id], self.instances.get(a.src), self.instances.get(a.dst)
        plan = self.plans.get(a.request_id)
        movable = (
            rec.state == "pending"
            and plan is not None
            and not plan.decode_shards
            and all(isinstance(d, SimDecode) and not isinstance(d, SimColocated) for d in (src, dst))
            and rec in src.waiting  # type: ignore[union-attr]
        )
        if not movable:
            self.core.move_refused(a.request_id, "not parked there")
            return
        assert isinstance(src, SimDecode) and isinstance(dst, SimDecode) and plan is not None
        src.waiting.remove(rec)
        self.plans[a.request_id] = dataclasses.replace(plan, decode_instance=dst.id)
        self._tails.pop(a.request_id, None)
        rec.decode_instance = dst.id
        rec.moves += 1
        self.core.moved(a.request_id, dst.id)
        dst.waiting.append(rec)
        for d in (src, dst):
            self._join_decode(d, now)
            self._start_step(d, now)

    # ---- preemption (swap to the kvstore) ----

    @staticmethod
    def _context(rec: RequestRecord) -> int:
        """KV tokens of a decoding request: the prompt and every output but the last (not fed back yet)."""
        return rec.num_prefill_tokens + len(rec.token_times) - 1

    def _kv_seconds(self, tokens: int) -> float:
        transfer = self.latency.transfer
        return 0.0 if transfer is None else transfer.predict(tokens * self.config.kv_bytes_per_token)

    def _preempt(self, a: Preempt, now: float) -> None:
        rec, d = self.records[a.request_id], self.instances.get(a.instance)
        decoding = isinstance(d, SimDecode) and not isinstance(d, SimColocated) and rec in d.running
        if rec.state != "pending" or not decoding:
            self.core.preempt_refused(a.request_id, "not decoding there")
            return
        assert isinstance(d, SimDecode)
        if d.stepping:
            d.preempt_after_step.add(rec.request_id)
        else:
            self._swap_out(d, rec, now)

    def _swap_out(self, d: SimDecode, rec: RequestRecord, now: float) -> None:
        """Out of the batch now; its blocks free once the KV is in the kvstore."""
        d.running.remove(rec)
        self._add_kv(rec, -1)
        rec.preemptions += 1
        self.queue.push(now + self._kv_seconds(self._context(rec)), EventKind.SWAP_OUT_DONE, (d, rec, now))

    def _on_swap_out_done(self, now: float, payload: tuple[SimDecode, RequestRecord, float]) -> None:
        d, rec, started = payload
        self._free_decode(rec)
        if rec.state == "pending":
            event = Preempted(
                request_id=rec.request_id, instance_id=d.id, num_tokens=self._context(rec), seconds=now - started
            )
            self._emit(event, now)
        if rec.state == "pending":
            self._swapped.add(rec.request_id)
            d.waiting.append(rec)
        self._join_decode(d, now)
        self._start_step(d, now)
        self._retry_split_joins(now)

    def _on_swap_in_done(self, now: float, payload: tuple[SimDecode, RequestRecord]) -> None:
        d, rec = payload
        if rec.state == "pending":
            self._start_decoding(d, rec, now)
        else:
            self._free_decode(rec)
            self._join_decode(d, now)
            self._retry_split_joins(now)
        self._start_step(d, now)

    def _leave_decode(self, d: SimDecode, rec: RequestRecord) -> None:
        self._free_decode(rec)
        if rec in d.running:
            d.running.remove(rec)
            self._add_kv(rec, -1)

    def _fail(self, rec: RequestRecord, now: float, reason: str) -> None:
        """Abort everywhere: queued work is dropped when reached; held KV is freed now unless a step or
        chunk of the request is executing (then when it ends)."""
        if rec.state != "pending":
            return
        self._end(rec, "failed", now, reason)
        rid = rec.request_id
        if rid not in self.plans:
            return
        d = self.instances[rec.decode_instance]
        if isinstance(d, SimColocated):
            if rid in self._running or rec in d.step_batch:
                return  # the step in flight frees it
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
