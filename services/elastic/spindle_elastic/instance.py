"""Elastic (colocated) instance: prefills and decodes each request in one engine; no KV moves.

The scheduler plans a request onto this instance as both its prefill and its decode instance (the `chunked`
strategy). The engine's own scheduler runs it: every step takes the running decodes first, then prompt chunks
under the per-step token budget (`--max-num-batched-tokens`), so a long prompt is computed a chunk at a time
beside the decodes instead of stalling them (Sarathi-Serve, vLLM's chunked prefill). Progress goes to the
scheduler as the prefill instance reports it (`PrefillProgress` per chunk, `PrefillDone`), then `DecodeStarted`
at the first token; every token streams to the gateway from here.

A request of n > 1 choices is computed once (`prefill_only`) and its choices fork from that KV here
(`Engine.decode_held`).

Under a per-iteration strategy (`loongserve`) the scheduler names every iteration instead (`RunIteration`), in the
order the commands arrive; the first member answers `IterationDone` with the iteration's measured time. An
iteration of this instance alone, on requests whose whole KV is here, runs as one `Engine.step_directed` (prefill
parts and decodes batched). One that spans several instances, or holds a request in parts, runs with its group
(group.py: sequence-parallel prompts whose members retain their ranges, multi-master decodes). A decoding
request's KV can also move to another elastic instance (migrate.py).

With `spp_size` S > 1 the instance is a sequence pipeline (Medha's SPP): this process holds the first layer range
and leads an `SPPLeaderEngine`; stage processes (`python -m spindle_elastic.spp_stage`) at the next ranks hold the
rest, `tp_size` T ranks per stage (TP inside each stage: Medha's 2D; S x T processes in all). Consecutive chunks
of one prompt flow through the stages back to back. Such an instance moves no KV: it takes no group iterations,
migrations or n > 1 requests (they fail with a clear error).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from spindle_engine import Engine, EngineConfig, StepOutput
from spindle_engine.spp import PipelineLayout, SPPLeaderEngine, load_stage, spp_engine_config
from spindle_protocol import subjects
from spindle_protocol.messages import (
    Abort,
    DecodeStarted,
    IterationAbandoned,
    IterationDone,
    MigrateKVIn,
    MigrateKVOut,
    PrefillDone,
    RequestFailed,
    RequestSpec,
    RunIteration,
    RunPrefill,
    StreamEvent,
)
from spindle_worker import Instance, InstanceConfig, Job

from .group import GroupIterations
from .migrate import KVMigration

log = logging.getLogger("spindle.elastic")

DEFAULT_KV_CACHE_GB = 2.0  # an elastic instance (every member of a pipeline) holds every request's KV


@dataclass
class ElasticJob(Job):
    prefilled: bool = False  # the first token is out: decoding


class ElasticInstance(GroupIterations, KVMigration, Instance):
    preemptions_seen = 0  # the engine's in-place preemptions (recomputation) logged so far

    def __init__(self, config: InstanceConfig) -> None:
        super().__init__(config)
        self.abandoned: dict[int, threading.Event] = {}

    def make_engine(self) -> Engine:
        spp = self.config.spp_size
        if spp == 1:
            return super().make_engine()
        layout = PipelineLayout.consecutive(self.config.rank, spp, self.config.tp_size)
        config = spp_pipeline_config(self.config.engine, spp, layout.tp)
        model, head = load_stage(config, spp, 0, layout.stages[0])  # TP > 1: joined the data plane first
        assert head is not None
        return SPPLeaderEngine(config, model, head, layout)

    async def before_engine_stop(self) -> None:
        if isinstance(self.engine, SPPLeaderEngine) and self.thread.is_alive():
            with contextlib.suppress(Exception):
                await self.call(lambda e: e.close())

    async def serve(self) -> None:
        await self.bus.subscribe(subjects.prefill_run(self.id), RunPrefill, self._on_run)
        # one subscription runs its handler a message at a time: iterations keep the scheduler's order
        await self.bus.subscribe(subjects.elastic_iteration(self.id), RunIteration, self._on_iteration)
        await self.bus.subscribe(subjects.elastic_abandoned(self.id), IterationAbandoned, self.on_abandoned)
        await self.bus.subscribe(subjects.elastic_migrate_in(self.id), MigrateKVIn, self.on_migrate_in)
        await self.bus.subscribe(subjects.elastic_migrate_out(self.id), MigrateKVOut, self.on_migrate_out)

    # ---- per-iteration work (the scheduler names each step) ----

    async def _on_iteration(self, cmd: RunIteration, raw: Msg) -> None:
        t0 = time.perf_counter()
        if self.id not in cmd.members:
            log.error("%s: iteration %d for %s sent here", self.id, cmd.batch_id, cmd.members)
            return
        if cmd.members == [self.id] and await self.call(lambda e: _whole_here(e, cmd)):
            await self._run_alone(cmd, raw)
        else:
            await self.run_group(cmd, raw)
        if cmd.members[0] == self.id:
            done = IterationDone(instance_id=self.id, batch_id=cmd.batch_id, seconds=time.perf_counter() - t0)
            await self.bus.publish(subjects.EVENTS, done)

    async def _run_alone(self, cmd: RunIteration, raw: Msg) -> None:
        """One engine step: prefill parts and decodes batched (`Engine.step_directed`)."""
        for part in cmd.prefills:
            if part.start == 0:
                await self._admit_directed(part.request, raw)
        prefill = {p.request.request_id: p.end - p.start for p in cmd.prefills if p.request.request_id in self.jobs}
        decode = [d.request_id for d in cmd.decodes if d.request_id in self.jobs]

        def step(engine: Engine) -> tuple[list[StepOutput], dict[str, int]]:  # aborted meanwhile: left out
            alive = {r: n for r, n in prefill.items() if r in engine.directed}
            seqs = {r: engine.directed[r] for r in decode if r in engine.directed}
            sent = {r: s.num_tokens - s.num_prompt_tokens for r, s in seqs.items()}  # another master may have sent some
            return engine.step_directed(alive, list(seqs)), sent

        outputs: list[StepOutput] = []
        sent: dict[str, int] = {}
        try:
            outputs, sent = await self.call(step)
        except ValueError as e:  # the scheduler's plan does not fit this engine: its requests fail, not the instance
            for rid in [*prefill, *decode]:
                if (job := self.jobs.get(rid)) is not None:
                    await self.fail(job, 500, f"iteration {cmd.batch_id} on {self.id}: {e}")
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if not isinstance(job, ElasticJob):
                continue
            job.next_seq = sent.get(out.request_id, job.next_seq)
            if not job.prefilled:
                job.prefilled = True
                job.stats["prefill_ms"] = (time.time() - job.started) * 1e3
                await self.report_prefilled(job, finished=out.finished)
            if out.finished:
                job.stats["decode_ms"] = (time.time() - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
                await self.finish(job, out.new_token_ids, out.finish_reason or "stop", out.logprobs)
            else:
                await self.publish_tokens(job, out.new_token_ids, None, out.logprobs)

    async def _admit_directed(self, spec: RequestSpec, raw: Msg) -> None:
        """A request's first part: its job, its prompt loaded, held in the engine for directed steps."""
        job = self.new_job(spec, raw)
        if job is not None:
            await self.add_to_engine(job, prefill_only=False, directed=True)

    def new_job(self, spec: RequestSpec, raw: Msg) -> ElasticJob | None:
        """The request's job here (None when it already has one, or was aborted)."""
        job = self.start_job(spec, raw, ElasticJob)
        assert job is None or isinstance(job, ElasticJob)
        return job

    async def _on_run(self, cmd: RunPrefill, raw: Msg) -> None:
        spec = cmd.request
        job = self.new_job(spec, raw)
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
                    self.from_thread(self.report_prefilled(job, finished=False))
                else:
                    self.from_thread(self.fail(job, 503, f"no KV room for {job.spec.sampling.n} choices on {self.id}"))
                continue
            if not job.prefilled:
                job.prefilled = True
                job.stats["prefill_ms"] = (t1 - job.started) * 1e3
                self.from_thread(self.report_prefilled(job, finished=out.finished and job.spec.sampling.n == 1))
            if out.finished:
                job.stats["decode_ms"] = (t1 - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
                reason = out.finish_reason or "stop"
                coro = self.finish(job, out.new_token_ids, reason, out.logprobs, out.choice, out.prompt_logprobs)
            else:
                coro = self.publish_tokens(job, out.new_token_ids, None, out.logprobs, out.choice, out.prompt_logprobs)
            self.from_thread(coro)

    # ---- on the event loop ----

    async def report_prefilled(self, job: ElasticJob, finished: bool) -> None:
        """The prompt is computed: the scheduler's prefill phase ends and (unless the first token ended it)
        decoding starts here."""
        if self.jobs.get(job.request_id) is not job:
            return
        elapsed = job.stats["prefill_ms"] / 1e3
        done = PrefillDone(request_id=job.request_id, instance_id=self.id, seconds=elapsed, finished=finished)
        await self.bus.publish(subjects.EVENTS, done)
        if not finished:
            await self.bus.publish(subjects.EVENTS, DecodeStarted(request_id=job.request_id, instance_id=self.id))

    def forget(self, rid: str) -> None:
        """This instance no longer holds or masters `rid`: its job ends here without an event."""
        job = self.jobs.pop(rid, None)
        if job is not None:
            job.span.end()

    async def fail_request(self, rid: str, status: int, message: str) -> None:
        """`fail` the request's job here, or report the failure when this instance has no job of it."""
        if (job := self.jobs.get(rid)) is not None:
            await self.fail(job, status, message)
            return
        await self.call(lambda e: e.abort(rid))
        await self.bus.publish(subjects.stream(rid), StreamEvent(request_id=rid, seq=0, error=message, status=status))
        await self.bus.publish(
            subjects.EVENTS, RequestFailed(request_id=rid, instance_id=self.id, message=message, status=status)
        )
        await self.bus.publish(subjects.ABORT, Abort(request_id=rid, reason=message))


def _whole_here(engine: Engine, cmd: RunIteration) -> bool:
    """Every decode of the iteration is directed here with its whole KV (the engine's own step can run it)."""
    return all((s := engine.directed.get(d.request_id)) is not None and s.kv_positions is None for d in cmd.decodes)


def spp_pipeline_config(config: EngineConfig, spp: int, tp: int = 1) -> EngineConfig:
    """The engine configuration of every member of an `spp`-stage instance of TP `tp` per stage (the stage processes
    compute it too)."""
    from spindle_model import resolve_model

    return spp_engine_config(config, resolve_model(config.model).config, spp, tp)
