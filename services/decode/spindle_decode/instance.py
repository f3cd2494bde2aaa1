"""Decode instance: the receiving side of the KV hand-off, then continuous batching and token streaming.

A `ReserveKV` reserves blocks (or answers `no_space`), posts a receive and answers with its tag; once the
tensor is in, the request joins the batch. A `KVParked` request waits in FIFO order until its blocks
are free, then its KV is pulled from the kvstore the same way; so does a request preempted to the kvstore
(`PreemptDecode`, preempt.py), which then resumes where it stopped. `MoveParked` hands a parked request to
another decode instance (a `KVParked` to it, with the tokens and stream position a preempted one needs). An
SP-prefilled prompt arrives in parts from several holders, directly or parked (sp_receive.py); parked, it waits
here as one range in tiled order and is put back in prompt order once pulled.

With `tp_size` T > 1 this process leads a tensor-parallel instance of T consecutive ranks: its engine is a
`TPLeaderEngine` that mirrors every call to the followers (`python -m spindle_decode.tp_follower`) and steps
with them. A prompt's KV comes to every rank directly: the leader's `ReserveReply` gives the holder the ranks, their
KV-head ranges and one tag per rank, tells each follower (through the TP control stream) to post its receive, and
the holder sends each rank only its heads (`receive_direct`). KV pulled from the kvstore (parked or preempted
requests) still arrives here whole; the leader keeps its heads and forwards each follower its slice with the
mirrored call. Stats counters report the KV bytes each rank received directly and the bytes forwarded. Only the
leader talks NATS. A follower that dies or hangs stops the engine
thread (TPError), and the instance fails every request it holds and exits non-zero.

With `kvp_size` K > 1 it leads a KV-parallel group instead (kvp_lockstep.py): K member processes at consecutive
ranks, each holding token ranges of the requests' KV and each registered as a decode instance (this process answers
their subjects); the scheduler's `PlaceKVP` says where a request's KV goes. KV arrives here whole and the leader
forwards each member its token range; a dead follower fails only the requests it had a part in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from spindle_attention.distributed.comm import RankGroup
from spindle_engine import Engine, StepOutput
from spindle_engine.kvp.lockstep import KVPLeaderEngine
from spindle_engine.tp import TPLeaderEngine, leader_engine, to_runs
from spindle_protocol import subjects
from spindle_protocol.messages import (
    DecodeStarted,
    InstanceInfo,
    InstanceStats,
    KVGet,
    KVGetReply,
    KVParked,
    MoveParked,
    MoveReply,
    PreemptDecode,
    RequestSpec,
    ReserveKV,
    ReserveReply,
    SPChunkSpec,
    TensorHeader,
)
from spindle_protocol.prompts import load_prompt
from spindle_protocol.tensor_header import header_for
from spindle_telemetry import extract
from spindle_transfer import dtype_name
from spindle_worker import Instance, Job, sampling_params
from spindle_worker.sp_plan import tiling, untile

from . import kvp_lockstep, preempt, sp_receive

log = logging.getLogger("spindle.decode")

RECEIVE_TIMEOUT_S = 120.0


@dataclass
class DecodeJob(Job):
    cancel: threading.Event = field(default_factory=threading.Event)
    decoding: bool = False


@dataclass(frozen=True)
class Parked:
    """A request whose KV waits in the kvstore for blocks here: `num_tokens` tokens under `kv`."""

    job: DecodeJob
    kvstore_instance: str
    kvstore_rank: int
    kv: TensorHeader
    num_tokens: int
    first_token: int = -1  # parked by a prefill instance: the prompt's KV and its first output
    resume: preempt.Resume | None = None  # preempted here: the tokens it continues from
    tiled: tuple[SPChunkSpec, ...] = ()  # an SP prompt's parts in tiled order: un-permute by this plan


class DecodeInstance(Instance):
    def __init__(self, *args, kvp: kvp_lockstep.KVPOptions | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvp = kvp or kvp_lockstep.KVPOptions()
        self.parked: OrderedDict[str, Parked] = OrderedDict()
        self.blocks_freed = asyncio.Event()
        self.sp_parts: dict[str, sp_receive.PartsInFlight] = {}  # SP prompts whose parts are on their way
        self.kvp_shards: dict[str, list[tuple[int, int, int]]] = {}  # KVP group: the scheduler's placements

    async def serve(self) -> None:
        if isinstance(self.engine, KVPLeaderEngine):
            await kvp_lockstep.connect(self)
            await kvp_lockstep.subscribe(self)
        await self.bus.subscribe(subjects.decode_reserve(self.id), ReserveKV, self._on_reserve)
        await self.bus.subscribe(subjects.decode_parked(self.id), KVParked, self._on_parked)
        await self.bus.subscribe(subjects.decode_preempt(self.id), PreemptDecode, self.on_preempt)
        await self.bus.subscribe(subjects.decode_move(self.id), MoveParked, self._on_move)
        self.spawn(self._pump_parked())

    # ---- tensor parallelism ----

    def make_engine(self) -> Engine:
        cfg = self.config
        if self.kvp.size > 1:
            return kvp_lockstep.make_engine(self)
        if cfg.tp_size == 1:
            return super().make_engine()
        return leader_engine(cfg.engine, RankGroup(tuple(range(cfg.rank, cfg.rank + cfg.tp_size))))

    def import_kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The KV a request arrives with: every KV head (a TP leader forwards the followers their heads)."""
        if isinstance(self.engine, TPLeaderEngine | KVPLeaderEngine):
            return self.engine.import_kv_shape(num_tokens)
        return self.engine.kv_shape(num_tokens)

    async def on_preempt(self, msg: PreemptDecode, raw: Msg) -> Any:
        return await preempt.on_preempt(self, msg, raw)

    def blocks_held(self) -> dict[str, int]:
        """Per request; a TP instance adds `tp-rank-R: blocks` for each follower rank R that holds any."""
        out = super().blocks_held()
        if isinstance(self.engine, TPLeaderEngine):
            for peer, used in zip(self.engine.followers, self.engine.follower_blocks_used, strict=True):
                if used:
                    out[f"tp-rank-{peer}"] = used
        return out

    def base_info(self) -> InstanceInfo:
        return super().info()

    def info(self) -> InstanceInfo:
        if isinstance(self.engine, KVPLeaderEngine):  # member 0's own entry
            info = kvp_lockstep.member_info(self, self.engine, 0)
            assert info is not None
            return info
        return super().info()

    def registry_entries(self) -> list[Callable[[], InstanceInfo | None]]:
        if isinstance(self.engine, KVPLeaderEngine):
            return kvp_lockstep.registry_entries(self)
        return super().registry_entries()

    async def reserve_blocks(self, spec: RequestSpec, num_tokens: int) -> bool:
        """Reserve a request's KV blocks on the engine, once per choice (a KVP group: at the scheduler's placement,
        if it sent one, its outputs' growth counted; one choice only)."""
        request_id, max_tokens, n = spec.request_id, spec.sampling.max_tokens, spec.sampling.n
        if isinstance(self.engine, KVPLeaderEngine):
            if n > 1:
                raise ValueError(f"n = {n}: a KV-parallel decode group decodes one choice per request")
            shards = self.kvp_shards.get(request_id)
            ok = await self.call(lambda e: e.reserve(request_id, num_tokens, shards, max_tokens))
        else:
            ok = await self.call(lambda e: e.reserve(request_id, num_tokens, n))
        if ok:
            self.kvp_shards.pop(request_id, None)
        return ok

    async def _on_stats(self, msg: Any, raw: Msg) -> InstanceStats:
        stats = await super()._on_stats(msg, raw)
        if isinstance(self.engine, KVPLeaderEngine):
            own = kvp_lockstep.member_stats(self, self.engine, 0)
            stats = msgspec.structs.replace(own, counters=stats.counters)
        if isinstance(self.engine, TPLeaderEngine):
            e = self.engine
            direct = [e.direct_bytes, *e.follower_direct_bytes]
            counters = {f"tp_kv_direct_bytes_tp{t}": b for t, b in enumerate(direct)}
            counters["tp_kv_forwarded_bytes"] = e.forwarded_bytes
            stats = msgspec.structs.replace(stats, counters={**stats.counters, **counters})
        return kvp_lockstep.with_counters(stats, self.engine)

    async def receive_direct(
        self, request_id: str, src: int, positions: torch.Tensor
    ) -> tuple[ReserveReply, TensorHeader]:
        """TP: every rank of this instance receives its KV heads for `positions` from holder `src` itself (the
        followers post their receives when the mirrored call reaches them). Returns the holder's reply and the
        header of this rank's own receive, under `reply.tag`."""
        engine = self.engine
        assert isinstance(engine, TPLeaderEngine)
        tags = [self.dp.new_tag() for _ in range(engine.tp_size)]
        runs = to_runs(positions)
        await self.call(lambda e: e.receive_direct(request_id, src, tags, runs))
        header = header_for(dtype_name(engine.cache.k.dtype), engine.kv_shape(positions.numel()))
        reply = ReserveReply(
            accepted=True,
            tag=tags[0],
            tp_ranks=list(engine.group.ranks),
            tp_tags=tags,
            tp_heads=[list(h) for h in engine.heads],
        )
        return reply, header

    async def before_engine_stop(self) -> None:
        if isinstance(self.engine, TPLeaderEngine | KVPLeaderEngine) and self.thread.is_alive():
            with contextlib.suppress(Exception):
                await self.call(lambda e: e.close())

    def _expected_header(self, num_tokens: int) -> TensorHeader:
        return header_for(dtype_name(self.engine.cache.k.dtype), self.import_kv_shape(num_tokens))

    def _new_job(
        self, spec: RequestSpec, headers: dict[str, str] | None, prefill: ReserveKV | KVParked | None = None
    ) -> DecodeJob:
        """A decode job; `prefill` (the KV's announcement) brings the prefill's usage stats."""
        span = self.tracer.start_span("decode", context=extract(headers))
        span.set_attribute("spindle.request_id", spec.request_id)
        span.set_attribute("spindle.instance", self.id)
        # output 0 came from the prefill instance, unless every choice (n > 1) samples its first output here
        job = DecodeJob(spec, span, next_seq=1 if spec.sampling.n == 1 else 0)
        if prefill is not None and prefill.prefill_ms is not None:
            job.stats["prefill_ms"] = prefill.prefill_ms
        if prefill is not None and prefill.csa_dropped_tokens:
            job.stats["csa_dropped_tokens"] = float(prefill.csa_dropped_tokens)
        self.jobs[spec.request_id] = job
        return job

    # ---- direct hand-off ----

    async def _on_reserve(self, msg: ReserveKV, raw: Msg) -> ReserveReply:
        if msg.part is not None:
            return await sp_receive.on_reserve_part(self, msg, raw)
        spec = msg.request
        rid = spec.request_id
        n = spec.prompt.num_tokens
        if self.is_aborted(rid) or rid in self.jobs:
            return ReserveReply(accepted=False, reason="aborted or duplicate request")
        try:
            if msg.kv != self._expected_header(n):
                return ReserveReply(accepted=False, reason=f"bad_header: expected {self._expected_header(n)}")
            ok = await self.reserve_blocks(spec, n)
        except ValueError as e:
            return ReserveReply(accepted=False, reason=str(e))
        if not ok:
            return ReserveReply(accepted=False, reason="no_space")
        job = self._new_job(spec, raw.headers, msg)
        reply, header = ReserveReply(accepted=True, tag=self.dp.new_tag()), msg.kv
        if isinstance(self.engine, TPLeaderEngine):  # each rank receives its heads from the holder
            try:
                reply, header = await self.receive_direct(rid, msg.src_rank, torch.arange(n))
            except Exception as e:  # the request went away meanwhile
                await self.give_up(job, e)
                return ReserveReply(accepted=False, reason=f"aborted or refused: {e}")
        receive = self._receive(
            job, src=msg.src_rank, tag=reply.tag, header=header, first_token=msg.first_token, nbytes=msg.kv.nbytes
        )
        self.spawn(receive)
        return reply

    async def _receive(
        self,
        job: DecodeJob,
        *,
        src: int,
        tag: int,
        header: TensorHeader,
        first_token: int = -1,
        resume: preempt.Resume | None = None,
        tiled: tuple[SPChunkSpec, ...] = (),
        nbytes: int = 0,
    ) -> None:
        """Receive the KV, then decode: a prompt's with `first_token`, or a preempted request's (`resume`).
        With `tiled`, the KV is an SP prompt's parts in tiled order (spindle_worker.sp_plan.untile). `nbytes`:
        the KV's bytes over every rank when this rank receives only its heads (default: `header`'s)."""
        rid = job.request_id
        ctx = trace.set_span_in_context(job.span)
        try:
            with self.tracer.start_as_current_span("kv.receive", context=ctx) as span:
                t0 = time.time()
                span.set_attribute("spindle.bytes", header.nbytes)
                # onto the engine's device, unless tiled: untile assembles on the host (and the cache takes either)
                device = None if tiled else self.config.device
                recv = self.dp.recv_async(
                    header, src, tag, cancel=job.cancel, timeout_s=RECEIVE_TIMEOUT_S, device=device
                )
                if resume is None:
                    kv, prompt = await asyncio.gather(recv, load_prompt(self.bus, job.spec.prompt))
                    if tiled:
                        kv = untile(kv, tiled)
                    tokens, num_prompt = [*prompt, first_token], len(prompt)
                    job.stats["transfer_ms"] = (time.time() - t0) * 1e3
                    job.stats["kv_bytes"] = float(nbytes or header.nbytes)
                else:
                    kv = await recv
                    tokens, num_prompt = resume.token_ids, resume.num_prompt_tokens
                    job.stats["resume_ms"] = job.stats.get("resume_ms", 0.0) + (time.time() - t0) * 1e3
            if self.jobs.get(rid) is not job:
                raise RuntimeError("aborted")
            params = sampling_params(job.spec.sampling)
            await self.call(lambda e: e.resume(rid, tokens, num_prompt, kv, params))
        except Exception as e:
            await self.give_up(job, e)
            return
        job.decoding = True
        if resume is None:
            job.started = time.time()
        await self.bus.publish(subjects.EVENTS, DecodeStarted(request_id=rid, instance_id=self.id))

    async def give_up(self, job: DecodeJob, error: Exception) -> None:
        """A receive failed (or the request went away): free the reservation, fail the request if still ours."""
        with contextlib.suppress(Exception):
            await self.call(lambda e: e.cancel_reservation(job.request_id))
        if self.jobs.get(job.request_id) is job:
            await self.fail(job, 503, f"KV receive failed: {error}")

    # ---- parked in the kvstore ----

    async def _on_parked(self, msg: KVParked, raw: Msg) -> None:
        if msg.part is not None:
            await sp_receive.on_parked_part(self, msg, raw)
            return
        rid = msg.request.request_id
        if self.is_aborted(rid) or rid in self.jobs:
            return
        if msg.tiled:
            try:
                tiling(msg.tiled, msg.request.prompt.num_tokens)
            except ValueError as e:
                log.warning("parked KV of %s comes with a bad plan: %s", rid, e)
                return
        resume = None
        n = msg.request.prompt.num_tokens
        if msg.token_ids is not None:  # moved here after a preemption elsewhere: it continues from its tokens
            resume = preempt.Resume(list(msg.token_ids), n)
            n = len(msg.token_ids) - 1
        if msg.kv != self._expected_header(n):
            log.warning("parked KV of %s has an unexpected header %s", rid, msg.kv)
            return
        job = self._new_job(msg.request, raw.headers, msg)
        job.next_seq = msg.next_seq
        self.parked[rid] = Parked(
            job,
            msg.kvstore_instance,
            msg.kvstore_rank,
            msg.kv,
            n,
            first_token=msg.first_token,
            resume=resume,
            tiled=tuple(msg.tiled),
        )
        self.blocks_freed.set()

    async def _on_move(self, msg: MoveParked, raw: Msg) -> MoveReply:
        """Hand a parked request (not being pulled yet) to another decode instance, without ending it here."""
        rid = msg.request_id
        p = self.parked.get(rid)
        if p is None or self.jobs.get(rid) is not p.job or msg.dst_instance == self.id:
            return MoveReply(accepted=False, reason="not_parked")
        if isinstance(self.engine, KVPLeaderEngine) and kvp_lockstep.member_of(self, msg.dst_instance) is not None:
            return MoveReply(accepted=False, reason="the destination is a member of the same KV-parallel group")
        del self.parked[rid]
        moved = KVParked(
            request=p.job.spec,
            first_token=p.first_token,
            kvstore_instance=p.kvstore_instance,
            kvstore_rank=p.kvstore_rank,
            kv=p.kv,
            token_ids=None if p.resume is None else p.resume.token_ids,
            next_seq=p.job.next_seq,
            tiled=list(p.tiled),
        )
        await self.bus.publish(subjects.decode_parked(msg.dst_instance), moved)
        self.jobs.pop(rid, None)
        p.job.span.set_attribute("spindle.moved_to", msg.dst_instance)
        p.job.span.end()
        self.blocks_freed.set()  # the next parked request may fit
        return MoveReply(accepted=True)

    async def _pump_parked(self) -> None:
        """Pull parked requests in arrival order whenever their blocks fit."""
        while True:
            if not self.parked:
                self.blocks_freed.clear()
                await self.blocks_freed.wait()
                continue
            rid, p = next(iter(self.parked.items()))
            job, n = p.job, p.num_tokens
            if self.jobs.get(rid) is not job:
                self.parked.pop(rid, None)
                continue
            try:
                ok = await self.reserve_blocks(job.spec, n)
            except ValueError as e:
                self.parked.pop(rid, None)
                await self.fail(job, 400, str(e))
                continue
            if ok and self.parked.get(rid) is not p:  # moved away (or aborted) while the blocks were reserved
                await self.call(lambda e, rid=rid: e.cancel_reservation(rid))
                continue
            if not ok:
                self.blocks_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.blocks_freed.wait(), 0.5)
                continue
            self.parked.pop(rid, None)
            if p.resume is None:  # a resumed preemption counts under "preemptions"
                job.stats["parked"] = 1.0
            tag = self.dp.new_tag()
            receive = self.spawn(
                self._receive(
                    job,
                    src=p.kvstore_rank,
                    tag=tag,
                    header=p.kv,
                    first_token=p.first_token,
                    resume=p.resume,
                    tiled=p.tiled,
                )
            )
            await asyncio.sleep(0)  # let the receive post before the kvstore sends
            try:
                reply = await self.bus.request(
                    subjects.kvstore_get(p.kvstore_instance),
                    KVGet(request_id=rid, start=0, end=n, dst_rank=self.dp.rank, tag=tag, free_after=True),
                    KVGetReply,
                    timeout=10.0,
                )
                if not reply.found:
                    raise RuntimeError(f"the kvstore no longer holds it: {reply.reason}")
            except Exception as e:
                job.cancel.set()
                await receive
                if self.jobs.get(rid) is job:
                    await self.fail(job, 503, f"could not pull parked KV: {e}")

    async def on_abort_job(self, request_id: str) -> None:
        self.parked.pop(request_id, None)
        self.kvp_shards.pop(request_id, None)
        sp_receive.forget(self, request_id)
        job = self.jobs.get(request_id)
        if isinstance(job, DecodeJob):
            job.cancel.set()

    # ---- streaming ----

    def on_outputs(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                self.engine.abort(out.request_id)
                continue
            if out.finished:
                job.stats["decode_ms"] = (t1 - job.started) * 1e3
                reason = out.finish_reason or "stop"
                self.from_thread(self.finish(job, out.new_token_ids, reason, out.logprobs, out.choice))
            else:
                self.from_thread(self.publish_tokens(job, out.new_token_ids, None, out.logprobs, out.choice))
        if isinstance(self.engine, KVPLeaderEngine):
            kvp_lockstep.fail_dropped(self, self.engine)
            kvp_lockstep.report_placements(self, self.engine)
        if any(o.finished for o in outputs):
            self.loop.call_soon_threadsafe(self.blocks_freed.set)
