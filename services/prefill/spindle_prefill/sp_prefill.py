"""Sequence-parallel prefill on a prefill instance: this instance's side of a multi-instance plan.

Every member of a plan gets the same `RunPrefill` (with `chunks`). Members run their chunks on the engine
thread, blocking it, collectively with the group (ring or all-to-all over the data plane), so two members
must run their SP jobs in the same order or they would wait on each other forever: the scheduler publishes
each plan to all its members before the next plan, NATS keeps that order per subscriber, and each instance
runs its SP jobs one at a time in arrival order (`SPQueue`). Once queued, a job always runs its chunks even
if the request is aborted meanwhile (a member that skipped would leave its group waiting); the result is
then dropped. A dead peer makes the group's waits fail, and the request fails with 503 on every member.
A member that joins a growing plan later waits for the group's earlier chunks on the event loop, not on its
engine thread (sp_gate.py), so its engine serves other work meanwhile.

After the last chunk the member that computed the last prompt token samples the first token and streams
it; every member that holds KV hands its share to the decode instance (`ReserveKV` with a `KVPart`), or parks it
in the kvstore at its place in the tiled order (the holders' parts one after another, in member order) when the
decode instance has no room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch

from spindle_engine import Engine
from spindle_engine.sampler import Sampled, sample
from spindle_engine.sequence import Sequence
from spindle_engine.sp import ChunkReport, SPPrefill, csa_dropped_tokens
from spindle_protocol import subjects
from spindle_protocol.messages import Abort, KVPart, PrefillDone, SPChunkDone, SPChunkSpec
from spindle_protocol.prompts import load_prompt
from spindle_worker import sampling_params
from spindle_worker.sp_plan import plan_from_chunks, tiling

from .handoff import hand_off
from .sp_gate import all_joiners, joiners_after, joins_at

if TYPE_CHECKING:
    from .instance import PrefillInstance, PrefillJob

# After an abort, how long a joining member still waits for its group's earlier chunks (the group runs a
# queued plan to its end; a missing member makes the others wait until their data plane's 60 s timeout).
JOIN_ABORT_GRACE_S = 30.0

log = logging.getLogger("spindle.prefill.sp")


class SPQueue:
    """Runs this instance's SP jobs one at a time, in the order their commands arrived."""

    def __init__(self, inst: PrefillInstance) -> None:
        self.inst = inst
        self.queue: asyncio.Queue[PrefillJob] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    def submit(self, job: PrefillJob) -> None:
        """Queue `job` now, before any await, so the arrival order is kept."""
        self.queue.put_nowait(job)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._consume())

    async def _consume(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await run_sp_job(self.inst, job)
            except Exception:
                log.exception("SP prefill of %s failed", job.request_id)
            finally:
                self.inst.sp_gate.forget(job.request_id)


async def run_sp_job(inst: PrefillInstance, job: PrefillJob) -> None:
    cmd = job.command
    assert cmd is not None
    spec, rid = cmd.request, job.request_id
    try:
        plan, ids = plan_from_chunks(cmd.chunks)
        member = ids.index(inst.id)
        ranks = {i: cmd.ranks[m] for i, m in enumerate(ids)}
        prompt = await load_prompt(inst.bus, spec.prompt)
        inst.engine.validate_prompt(prompt)  # reads only the engine's fixed limits
        params = sampling_params(spec.sampling)
        csa_drop = cmd.csa_drop if cmd.csa_drop or cmd.csa_levels else None
        csa_levels = cmd.csa_levels or None
        if csa_drop is not None:  # CSA's checks (its plan, its settings) before any chunk runs
            job.stats["csa_dropped_tokens"] = csa_dropped_tokens(plan, csa_drop, csa_levels, cmd.csa_rule)
    except (ValueError, KeyError) as e:  # members would wait for us until their data-plane timeout
        await _give_up(inst, cmd.chunks, rid, str(e))
        await inst.fail(job, 400, f"bad SP request: {e}")
        return
    join = joins_at(cmd.chunks, inst.id)
    if join > 0:
        why = await inst.sp_gate.wait(
            rid, join - 1, set(cmd.chunks[join - 1].members), lambda: inst.is_aborted(rid), JOIN_ABORT_GRACE_S
        )
        if why:
            await _give_up(inst, cmd.chunks, rid, why)
            await inst.fail(job, 503, f"sequence-parallel prefill failed: {why}")
            return

    def work(engine: Engine) -> tuple[Sampled | None, torch.Tensor, list]:
        sp = SPPrefill(engine.model, engine.cache, engine.allocator, rid, prompt, plan, member, ranks,
                       csa_drop=csa_drop, csa_levels=csa_levels, csa_rule=cmd.csa_rule)  # fmt: skip
        for k in sp.chunk_indices:
            t0 = time.time()
            logits = sp.run_chunk_or_release(k)
            c = plan.chunks[k]
            inst.from_thread(_progress(inst, job, c.start, c.end, t0, time.time(), sp.reports[-1]))
            inst.from_thread(_tell_joiners(inst, cmd.chunks, rid, k))
        sampled = None
        if logits is not None:
            seq = Sequence(rid, list(prompt), params)
            sampled = sample(logits[None], [seq], engine.generator, engine.eos_token_ids, engine.grammars)
        kv = sp.held.export()  # [2, L, n, Hkv, D]
        sp.release()
        return sampled, kv, sp.reports

    t0 = time.time()
    try:
        sampled, kv, reports = await inst.call(work)
    except Exception as e:  # gloo reports a dead peer as a closed or reset connection
        cause = str(e).split(". This is typically", 1)[0]
        cause = cause.split("] ", 1)[-1] if cause.startswith("[") else cause
        await _give_up(inst, cmd.chunks, rid, cause)
        await inst.fail(job, 503, f"sequence-parallel prefill failed (a group member died or is unreachable?): {cause}")
        return
    if inst.is_aborted(rid) or inst.jobs.get(rid) is not job:
        inst.jobs.pop(rid, None)
        return  # aborted or failed meanwhile: the KV is dropped (its blocks are already free)
    job.stats["prefill_ms"] = (time.time() - t0) * 1e3
    job.span.set_attribute("spindle.sp_chunks", len(reports))
    first = None
    if sampled is not None:
        first = sampled.tokens[0]
        reason = None
        if params.n == 1:  # with n > 1 the decode instance samples every choice's first token
            await inst.publish_tokens(job, [first], logprobs=[lp] if (lp := sampled.logprobs[0]) else None)
            seq = Sequence(rid, [*prompt, first], params, num_prompt_tokens=len(prompt))
            reason = inst.engine._stop_reason(seq, first)
        await inst.bus.publish(
            subjects.EVENTS,
            PrefillDone(request_id=rid, instance_id=inst.id, seconds=time.time() - job.started, finished=bool(reason)),
        )
        if reason:  # nothing to decode: end here and tell the other members to drop their KV
            await inst.finish(job, [], reason)
            await inst.bus.publish(subjects.ABORT, Abort(request_id=rid, reason="finished at the first token"))
            return
    placement, starts = tiling(cmd.chunks, len(prompt))
    holders = [m for m, pos in placement.items() if pos.numel()]
    tile_start = starts[inst.id]  # where this part goes when it parks in the kvstore
    if kv.shape[2] == 0:
        inst.jobs.pop(rid, None)
        job.span.end()
        return
    part = KVPart(member=inst.id, num_parts=len(holders), chunks=cmd.chunks)
    try:
        await hand_off(inst, job, -1 if first is None else first, kv, part, tile_start)
    except Exception as e:
        if inst.jobs.get(rid) is job:
            log.exception("hand-off of %s's KV part failed", rid)
            await inst.fail(job, 503, f"KV hand-off failed: {e}")
        return
    if inst.jobs.pop(rid, None) is not None:
        job.span.end()


async def _tell_joiners(inst: PrefillInstance, chunks: list[SPChunkSpec], rid: str, k: int) -> None:
    for joiner in joiners_after(chunks, k):
        await inst.bus.publish(
            subjects.prefill_sp_chunk_done(joiner), SPChunkDone(request_id=rid, chunk=k, member=inst.id)
        )


async def _give_up(inst: PrefillInstance, chunks: list[SPChunkSpec], rid: str, why: str) -> None:
    """Tell every member that joins the plan after its start that this one will not get there."""
    for joiner in all_joiners(chunks):
        if joiner != inst.id:
            await inst.bus.publish(
                subjects.prefill_sp_chunk_done(joiner),
                SPChunkDone(request_id=rid, chunk=-1, member=inst.id, error=why or "failed"),
            )


async def _progress(
    inst: PrefillInstance, job: PrefillJob, start: int, done: int, t0: float, t1: float, report: ChunkReport
) -> None:
    """One chunk of the plan done on this member: spans and progress event, as for a single-instance chunk."""
    attributes = {"spindle.tokens": report.tokens, "spindle.sp": report.sp, "spindle.layout": report.layout}
    attributes |= {"spindle.ring_bytes": report.ring_bytes, "spindle.rebalance_bytes": report.rebalance_bytes}
    await inst.record_chunk(job, start, done, t0, t1, attributes, report.ring_bytes, report.rebalance_bytes)
