"""Prefill instance: runs each prompt (chunked by the engine), streams the first token, hands KV off.

After the prompt's last chunk the engine keeps the KV (`prefill_only`); we copy it out, free the blocks
and run the hand-off (handoff.py) on the event loop, so the engine goes on with other prompts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg

from spindle_engine import StepOutput
from spindle_protocol import subjects
from spindle_protocol.messages import PrefillDone, RunPrefill, SPChunkDone
from spindle_telemetry import extract
from spindle_worker import Instance, Job

from .handoff import hand_off
from .sp_gate import SPJoinGate
from .sp_prefill import SPQueue

log = logging.getLogger("spindle.prefill")


@dataclass
class PrefillJob(Job):
    command: RunPrefill | None = None


class PrefillInstance(Instance):
    async def serve(self) -> None:
        self.sp_queue = SPQueue(self)
        self.sp_gate = SPJoinGate()
        await self.bus.subscribe(subjects.prefill_sp_chunk_done(self.id), SPChunkDone, self._on_sp_chunk_done)
        await self.bus.subscribe(subjects.prefill_run(self.id), RunPrefill, self._on_run)

    async def _on_sp_chunk_done(self, msg: SPChunkDone, raw: Msg) -> None:
        if msg.request_id in self.jobs:  # a late word about a plan that is over here is dropped
            self.sp_gate.notify(msg)

    async def _on_run(self, cmd: RunPrefill, raw: Msg) -> None:
        spec = cmd.request
        rid = spec.request_id
        if rid in self.jobs or (self.is_aborted(rid) and not cmd.chunks):
            return  # an SP job runs even when aborted: its group would wait for this member otherwise
        span = self.tracer.start_span("prefill", context=extract(raw.headers))
        span.set_attribute("spindle.request_id", rid)
        span.set_attribute("spindle.instance", self.id)
        job = PrefillJob(spec, span, command=cmd)
        self.jobs[rid] = job
        if cmd.chunks:
            self.sp_queue.submit(job)
            return
        await self.add_to_engine(job, prefill_only=True)

    def on_outputs(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        engine = self.engine
        self.report_prompt_progress(t0, t1)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                engine.abort(out.request_id)
                continue
            if out.kv_ready:
                self.from_thread(self._first_token(job, out))  # before the copy below
                kv = engine.export_kv(out.request_id)  # a copy: the blocks can go now
                engine.release(out.request_id)
                self.from_thread(self._prefilled(job, out.new_token_ids[0], kv))
            elif out.finished:
                self.from_thread(self._finished_at_first_token(job, out))

    async def _finished_at_first_token(self, job: PrefillJob, out: StepOutput) -> None:
        job.stats["prefill_ms"] = (time.time() - job.started) * 1e3
        await self.bus.publish(
            subjects.EVENTS,
            PrefillDone(
                request_id=job.request_id, instance_id=self.id, seconds=time.time() - job.started, finished=True
            ),
        )
        reason = out.finish_reason or "stop"
        await self.finish(job, out.new_token_ids, reason, out.logprobs, prompt_logprobs=out.prompt_logprobs)

    async def _first_token(self, job: PrefillJob, out: StepOutput) -> None:
        """Stream the first token; with n > 1 choices the decode instance samples every choice's first token."""
        if self.jobs.get(job.request_id) is job and job.spec.sampling.n == 1:
            tokens, lps = out.new_token_ids, out.logprobs
            await self.publish_tokens(job, tokens, logprobs=lps, prompt_logprobs=out.prompt_logprobs)

    async def _prefilled(self, job: PrefillJob, first_token: int, kv: torch.Tensor) -> None:
        if self.jobs.get(job.request_id) is not job:
            return  # aborted meanwhile
        elapsed = time.time() - job.started
        job.stats["prefill_ms"] = elapsed * 1e3
        await self.bus.publish(
            subjects.EVENTS,
            PrefillDone(request_id=job.request_id, instance_id=self.id, seconds=elapsed, finished=False),
        )
        try:
            await hand_off(self, job, first_token, kv)
        except Exception as e:  # the decode or kvstore side failed: the request cannot continue
            log.exception("hand-off of %s failed", job.request_id)
            await self.fail(job, 503, f"KV hand-off failed: {e}")
            return
        if self.jobs.pop(job.request_id, None) is not None:
            job.span.end()
