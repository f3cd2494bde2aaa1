"""An iteration that spans several elastic instances (or holds a request in parts): `spindle_engine.esp`.

Every member gets the same `RunIteration` and runs it with the group (`run_iteration`, on the engine thread):
prompts over the whole group in one ring pass, each member keeping the range its `retain` names; prompt chunks
that name a master (Medha's KV parallelism: the master computes them, attending the earlier KV wherever it is);
multi-master decodes, each request's master keeping its new token's KV. The member that samples a token publishes
it (the prompt's last-token member or the last chunk's master for the first one, the master after that); every
member that keeps part of a request keeps its job, silently, so it can master the request later; members forget
what they no longer hold.

What the iteration could not run is reported once, by the first member that objected (no KV room: 503; a prompt
that did not load: 400). A member that dies, or an exchange that fails, fails every request of the iteration on
the members that notice (503) and frees their parts everywhere (the failure's Abort); a member that gives up
tells the others (`IterationAbandoned`), which stop waiting for it at once instead of at their timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
from nats.aio.msg import Msg

from spindle_engine import Engine, SamplingParams
from spindle_engine.esp import ChunkWork, DecodeWork, ESPOutput, Flag, IterationResult, PrefillWork, run_iteration
from spindle_protocol import subjects
from spindle_protocol.messages import IterationAbandoned, IterationPrefill, KVShardSpec, RequestSpec, RunIteration
from spindle_protocol.prompts import load_prompt
from spindle_worker import InstanceConfig, Job, sampling_params

log = logging.getLogger("spindle.elastic.group")

EXCHANGE_TIMEOUT_S = 60.0  # the longest one member waits on another within an iteration
MAX_ABANDONED = 1024  # iterations given up elsewhere remembered before they run here


def _params_of(spec: bytes) -> SamplingParams:
    return sampling_params(msgspec.msgpack.decode(spec, type=RequestSpec).sampling)


class GroupIterations:
    """The group side of an elastic instance (mixed into `ElasticInstance`, which provides the attributes)."""

    id: str
    config: InstanceConfig
    jobs: dict[str, Job]
    abandoned: dict[int, threading.Event]  # per iteration: set when another member gave it up

    async def on_abandoned(self, msg: IterationAbandoned, raw: Msg) -> None:
        """Another member gave an iteration up: stop waiting for it (or do not start waiting)."""
        log.warning("%s: %s gave iteration %d up: %s", self.id, msg.instance_id, msg.batch_id, msg.reason)
        self.abandoned.setdefault(msg.batch_id, threading.Event()).set()
        while len(self.abandoned) > MAX_ABANDONED:  # ones that never ran here
            self.abandoned.pop(next(iter(self.abandoned)))

    async def run_group(self, cmd: RunIteration, raw: Msg) -> None:
        members = cmd.members
        me = members.index(self.id)
        rows = [p.request.request_id for p in cmd.prefills] + [d.request_id for d in cmd.decodes]
        try:
            if self.config.spp_size > 1 and self.config.tp_size > 1:
                raise ValueError("a pipeline with TP inside its stages runs its iterations alone (KV parallelism over "
                                 "such pipelines is not supported: medha:kvp=1)")  # fmt: skip
            ranks = [cmd.ranks[m] for m in members]
            decodes = [DecodeWork(d.request_id, members.index(d.master)) for d in cmd.decodes]
            prefills = [self._prefill_work(p.request, p.start, p.end, p.retain, members)
                        for p in cmd.prefills if not p.master]  # fmt: skip
            chunks = [_chunk_work(p, members) for p in cmd.prefills if p.master]
        except (KeyError, ValueError) as e:  # the same command on every member: all refuse it alike
            for rid in rows:
                await self._refuse(rid, 400 if me == 0 else 0, f"iteration {cmd.batch_id}: {e}")
            return
        errors: dict[str, str] = {}
        for p in cmd.prefills:
            if not p.master or (p.master == self.id and p.start == 0):  # a chunk's prompt loads on its master
                errors |= await self._load_directed(p.request, raw)
        aborted = {rid for rid in rows if self.is_aborted(rid)}
        specs = {rid: msgspec.msgpack.encode(self.jobs[rid].spec) for rid in rows if rid in self.jobs}

        cancel = self.abandoned.setdefault(cmd.batch_id, threading.Event())

        def work(engine: Engine) -> IterationResult:
            return run_iteration(
                engine, me, ranks, prefills, decodes, chunks=chunks, aborted=aborted, spec_of=specs.__getitem__,
                params_of=_params_of, batch_id=cmd.batch_id, cancel=cancel, timeout_s=EXCHANGE_TIMEOUT_S,
            )  # fmt: skip

        try:
            result: IterationResult = await self.call(work)
        except Exception as e:  # a member died or gave up: this iteration's requests end here
            cause = str(e).split(". This is typically", 1)[0]
            log.warning("%s: iteration %d with %s failed: %s", self.id, cmd.batch_id, members, cause)
            if not cancel.is_set():  # the others may wait for this member: tell them
                gone = IterationAbandoned(batch_id=cmd.batch_id, instance_id=self.id, reason=cause)
                for m in members:
                    if m != self.id:
                        await self.bus.publish(subjects.elastic_abandoned(m), gone)
            for rid in rows:
                await self._refuse(rid, 503, f"elastic group {members} failed (a member died?): {cause}")
            return
        finally:
            self.abandoned.pop(cmd.batch_id, None)
        chunked = {c.request_id for c in chunks}
        for rid, spec in result.handed.items():  # this member masters them from now on
            log.info("%s: masters %s from iteration %d on (handed over)", self.id, rid, cmd.batch_id)
            self._adopt_job(msgspec.msgpack.decode(spec, type=RequestSpec), raw, prefilled=rid not in chunked)
        for out in result.outputs:
            await self._publish(out)
        for rid in result.gone:
            self.forget(rid)
        for rid, flag in result.refused.items():
            if flag == Flag.NOT_LOADED:
                await self._refuse(rid, 400, errors.get(rid, "the prompt could not be loaded"))
            elif flag == Flag.OUT_OF_ORDER:
                await self._refuse(rid, 500, f"iteration {cmd.batch_id}: a chunk of {rid} out of order")
            else:
                await self._refuse(rid, 503, f"no KV room on {self.id} for iteration {cmd.batch_id}")

    def _prefill_work(
        self, spec: RequestSpec, start: int, end: int, retain: list[KVShardSpec], members: list[str]
    ) -> PrefillWork:
        if start != 0 or end != spec.prompt.num_tokens:
            raise ValueError(f"a group computes whole prompts, not tokens [{start}, {end}) of {spec.request_id}")
        if spec.sampling.n != 1:
            raise ValueError("an elastic group decodes one choice (n = 1)")
        return PrefillWork(spec.request_id, {members.index(s.instance): (s.start, s.end) for s in retain})

    async def _load_directed(self, spec: RequestSpec, raw: Msg) -> dict[str, str]:
        """The request's job here and its prompt directed in the engine; {request id: why} when it did not load."""
        rid = spec.request_id
        if rid in self.jobs or self.is_aborted(rid):
            return {}
        self.new_job(spec, raw)
        try:
            prompt = await load_prompt(self.bus, spec.prompt)
            params = sampling_params(spec.sampling)
            await self.call(lambda e: e.add_directed(rid, prompt, params))
        except ValueError as e:
            return {rid: str(e)}
        return {}

    def _adopt_job(self, spec: RequestSpec, raw: Msg, prefilled: bool) -> None:
        job = self.jobs.get(spec.request_id) or self.new_job(spec, raw)
        if job is not None:  # None: aborted meanwhile (the next iteration drops it)
            job.prefilled = job.prefilled or prefilled

    async def _publish(self, out: ESPOutput) -> None:
        job = self.jobs.get(out.request_id)
        if job is None:
            return
        job.next_seq = out.index
        lps = [out.logprobs] if out.logprobs is not None else None
        if out.index == 0:
            job.prefilled = True
            job.stats["prefill_ms"] = (time.time() - job.started) * 1e3
            await self.report_prefilled(job, finished=out.finish_reason is not None)
        if out.finish_reason is not None:
            job.stats["decode_ms"] = (time.time() - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
            await self.finish(job, [out.token], out.finish_reason, lps)
        else:
            await self.publish_tokens(job, [out.token], None, lps)

    async def _refuse(self, rid: str, status: int, message: str) -> None:
        """End `rid` here; with a status, also report it failed (status 0: another member reports it)."""
        if status:
            await self.fail_request(rid, status, message)  # frees it in the engine too
        else:
            await self.call(lambda e: e.abort(rid))
            self.forget(rid)


def _chunk_work(p: IterationPrefill, members: list[str]) -> ChunkWork:
    """A prompt chunk its master computes (Medha's KVP); ValueError when the command is not one."""
    rid = p.request.request_id
    if p.request.sampling.n != 1:
        raise ValueError("an elastic group decodes one choice (n = 1)")
    kept = [(s.instance, s.start, s.end) for s in p.retain]
    if kept != [(p.master, p.start, p.end)]:
        raise ValueError(f"tokens [{p.start}, {p.end}) of {rid} must stay on their master {p.master}")
    return ChunkWork(rid, members.index(p.master), p.start, p.end)
