"""Elastic (colocated) instance: prefills and decodes each request in one engine; no KV moves.

The scheduler plans a request onto this instance as both its prefill and its decode instance (the `chunked`
strategy). The engine's own scheduler runs it: every step takes the running decodes first, then prompt chunks
under the per-step token budget (`--max-num-batched-tokens`), so a long prompt is computed a chunk at a time
beside the decodes instead of stalling them (Sarathi-Serve, vLLM's chunked prefill). Progress goes to the
scheduler as the prefill instance reports it (`PrefillProgress` per chunk, `PrefillDone`), then `DecodeStarted`
at the first token; every token streams to the gateway from here.

A request of n > 1 choices is computed once (`prefill_only`) and its choices fork from that KV here
(`Engine.decode_held`).

Under a per-iteration strategy (`loongserve`) the scheduler names every iteration instead (`RunIteration`): the
prefill parts and decodes of the step, run with `Engine.step_directed` outside the engine's own batching, in the
order the commands arrive; the instance answers `IterationDone` with the step's measured time. So far a group
is this instance alone: an iteration naming other members fails its requests (501).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from spindle_engine import Engine, StepOutput
from spindle_protocol import subjects
from spindle_protocol.messages import (
    DecodeStarted,
    IterationDone,
    PrefillDone,
    RequestSpec,
    RunIteration,
    RunPrefill,
)
from spindle_telemetry import extract
from spindle_worker import Instance, Job

log = logging.getLogger("spindle.elastic")


@dataclass
class ElasticJob(Job):
    prefilled: bool = False  # the first token is out: decoding


class ElasticInstance(Instance):
    preemptions_seen = 0  # the engine's in-place preemptions (recomputation) logged so far

    async def serve(self) -> None:
        await self.bus.subscribe(subjects.prefill_run(self.id), RunPrefill, self._on_run)
        # one subscription runs its handler a message at a time: iterations keep the scheduler's order
        await self.bus.subscribe(subjects.elastic_iteration(self.id), RunIteration, self._on_iteration)

    # ---- per-iteration work (the scheduler names each step) ----

    async def _on_iteration(self, cmd: RunIteration, raw: Msg) -> None:
        t0 = time.perf_counter()
        for part in cmd.prefills:
            if part.start == 0:
                await self._admit_directed(part.request, raw, alone=cmd.members == [self.id])
        prefill = {p.request.request_id: p.end - p.start for p in cmd.prefills if p.request.request_id in self.jobs}
        decode = [d.request_id for d in cmd.decodes if d.request_id in self.jobs]

        def step(engine: Engine) -> list[StepOutput]:  # requests aborted meanwhile are left out
            alive = {r: n for r, n in prefill.items() if r in engine.directed}
            return engine.step_directed(alive, [r for r in decode if r in engine.directed])

        outputs: list[StepOutput] = []
        try:
            outputs = await self.call(step)
        except ValueError as e:  # the scheduler's plan does not fit this engine: its requests fail, not the instance
            for rid in [*prefill, *decode]:
                if (job := self.jobs.get(rid)) is not None:
                    await self.fail(job, 500, f"iteration {cmd.batch_id} on {self.id}: {e}")
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if not isinstance(job, ElasticJob):
                continue
            if not job.prefilled:
                job.prefilled = True
                job.stats["prefill_ms"] = (time.time() - job.started) * 1e3
                await self._prefilled(job, finished=out.finished)
            if out.finished:
                job.stats["decode_ms"] = (time.time() - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
                await self.finish(job, out.new_token_ids, out.finish_reason or "stop", out.logprobs)
            else:
                await self.publish_tokens(job, out.new_token_ids, None, out.logprobs)
        done = IterationDone(instance_id=self.id, batch_id=cmd.batch_id, seconds=time.perf_counter() - t0)
        await self.bus.publish(subjects.EVENTS, done)

    async def _admit_directed(self, spec: RequestSpec, raw: Msg, alone: bool) -> None:
        """A request's first part: its job, its prompt loaded, held in the engine for directed steps."""
        job = self._new_job(spec, raw)
        if job is None:
            return
        if not alone:
            await self.fail(job, 501, f"{self.id}: sequence-parallel groups of elastic instances are not served yet")
            return
        await self.add_to_engine(job, prefill_only=False, directed=True)

    def _new_job(self, spec: RequestSpec, raw: Msg) -> ElasticJob | None:
        """The request's job here (None when it already has one, or was aborted)."""
        rid = spec.request_id
        if rid in self.jobs or self.is_aborted(rid):
            return None
        span = self.tracer.start_span("elastic", context=extract(raw.headers))
        span.set_attribute("spindle.request_id", rid)
        span.set_attribute("spindle.instance", self.id)
        job = self.jobs[rid] = ElasticJob(spec, span)
        return job

    async def _on_run(self, cmd: RunPrefill, raw: Msg) -> None:
        spec = cmd.request
        job = self._new_job(spec, raw)
        if job is None:
            return
        if cmd.decode_instance != self.id or any(c.members != [self.id] for c in cmd.chunks):
            await self.fail(
                job, 500, f"elastic instance {self.id} runs colocated plans only (prefill and decode here), not a plan "
                f"that decodes on {cmd.decode_instance} or prefills on other members"
            )  # fmt: skip
            return
        await self.add_to_engine(job, prefill_only=spec.sampling.n > 1)

    # ---- on the engine thread, after each step ----

    def on_outputs(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        engine = self.engine
        if engine.scheduler.num_preemptions > self.preemptions_seen:
            self.preemptions_seen = engine.scheduler.num_preemptions
            log.warning(
                "%s: KV cache full: %d preemptions so far (requests recomputed from their tokens); a larger "
                "--kv-cache-memory-gb avoids the recomputation", self.id, self.preemptions_seen,
            )  # fmt: skip
        self.report_prompt_progress(t0, t1)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if not isinstance(job, ElasticJob):
                engine.abort(out.request_id)
                continue
            if out.kv_ready:  # n > 1: the prompt is in; its choices fork here and sample their own first tokens
                job.prefilled = True
                job.stats["prefill_ms"] = (t1 - job.started) * 1e3
                if engine.decode_held(out.request_id):
                    self.from_thread(self._prefilled(job, finished=False))
                else:
                    self.from_thread(self.fail(job, 503, f"no KV room for {job.spec.sampling.n} choices on {self.id}"))
                continue
            if not job.prefilled:
                job.prefilled = True
                job.stats["prefill_ms"] = (t1 - job.started) * 1e3
                self.from_thread(self._prefilled(job, finished=out.finished and job.spec.sampling.n == 1))
            if out.finished:
                job.stats["decode_ms"] = (t1 - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
                reason = out.finish_reason or "stop"
                coro = self.finish(job, out.new_token_ids, reason, out.logprobs, out.choice, out.prompt_logprobs)
            else:
                coro = self.publish_tokens(job, out.new_token_ids, None, out.logprobs, out.choice, out.prompt_logprobs)
            self.from_thread(coro)

    # ---- on the event loop ----

    async def _prefilled(self, job: ElasticJob, finished: bool) -> None:
        """The prompt is computed: the scheduler's prefill phase ends and (unless the first token ended it)
        decoding starts here."""
        if self.jobs.get(job.request_id) is not job:
            return
        elapsed = job.stats["prefill_ms"] / 1e3
        done = PrefillDone(request_id=job.request_id, instance_id=self.id, seconds=elapsed, finished=finished)
        await self.bus.publish(subjects.EVENTS, done)
        if not finished:
            await self.bus.publish(subjects.EVENTS, DecodeStarted(request_id=job.request_id, instance_id=self.id))
