"""Elastic (colocated) instance: prefills and decodes each request in one engine; no KV moves.

The scheduler plans a request onto this instance as both its prefill and its decode instance (the `chunked`
strategy). The engine's own scheduler runs it: every step takes the running decodes first, then prompt chunks
under the per-step token budget (`--max-num-batched-tokens`), so a long prompt is computed a chunk at a time
beside the decodes instead of stalling them (Sarathi-Serve, vLLM's chunked prefill). Progress goes to the
scheduler as the prefill instance reports it (`PrefillProgress` per chunk, `PrefillDone`), then `DecodeStarted`
at the first token; every token streams to the gateway from here.

A request of n > 1 choices is computed once (`prefill_only`) and its choices fork from that KV here
(`Engine.decode_held`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.aio.msg import Msg

from spindle_engine import StepOutput
from spindle_protocol import subjects
from spindle_protocol.messages import DecodeStarted, PrefillDone, RunPrefill
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

    async def _on_run(self, cmd: RunPrefill, raw: Msg) -> None:
        spec = cmd.request
        rid = spec.request_id
        if rid in self.jobs or self.is_aborted(rid):
            return
        span = self.tracer.start_span("elastic", context=extract(raw.headers))
        span.set_attribute("spindle.request_id", rid)
        span.set_attribute("spindle.instance", self.id)
        job = ElasticJob(spec, span)
        self.jobs[rid] = job
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
