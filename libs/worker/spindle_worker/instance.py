"""Base of a model instance service: engine thread + NATS bus + data plane + registry heartbeat.

Subclasses (PrefillInstance, DecodeInstance) subscribe their own subjects in `serve()` and handle engine
outputs in `on_outputs()`. Each request is a `Job` until it reaches its one terminal state: `finish()`
or `fail()` publish it, end its span and forget it; aborts free its blocks through the engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Span

from spindle_engine import Engine, EngineConfig, SamplingParams, StepOutput
from spindle_engine.engine_thread import EngineThread
from spindle_engine.sampler import TokenLogprobs
from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    Abort,
    InstanceInfo,
    InstanceStats,
    PrefillProgress,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    Sampling,
    StatsQuery,
    StreamEvent,
    TokenLogprob,
)
from spindle_protocol.prompts import load_prompt
from spindle_protocol.registry import run_heartbeat
from spindle_telemetry import extract, inject, setup, shutdown, tracer
from spindle_transfer import DataPlane

from .device import check_device, kv_cache_memory_gb

log = logging.getLogger("spindle.worker")

ABORT_MEMORY_S = 120.0  # how long an abort is remembered, for commands that arrive after it
DEADLINE_GRACE_S = 2.0  # the gateway ends a request at its deadline; instances drop it this much later


def sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        n=s.n,
        grammar=None if s.grammar is None else (s.grammar.kind, s.grammar.source),
    )


def wire_logprobs(logprobs: list[TokenLogprobs] | None) -> list[TokenLogprob] | None:
    """The engine's per-token logprobs as the token stream carries them."""
    if logprobs is None:
        return None
    return [TokenLogprob(lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs)) for lp in logprobs]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the flags of `spindle_protocol.service.add_engine_args` and
    `spindle_worker.device.add_device_args`; ValueError for a device this process does not have (checked now)."""
    device = check_device(args.device)
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_gb=kv_cache_memory_gb(args, device),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )


@dataclass(frozen=True)
class InstanceConfig:
    role: str
    instance_id: str
    nats_url: str
    rank: int
    world_size: int
    dist_init: str
    engine: EngineConfig
    otlp_endpoint: str | None = None
    tp_size: int = 1  # tensor-parallel ranks of this instance: this one (the leader) and the next tp_size - 1
    node: str = ""  # the node it reports in its heartbeats ("": the host name)
    # sequence-pipeline stages of this instance, each of tp_size ranks: this one (stage 0's first) and the next
    # spp_size * tp_size - 1 ranks
    spp_size: int = 1

    def __post_init__(self) -> None:
        subjects.check_token(self.instance_id, "instance id")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1 or self.rank + self.tp_size > self.world_size:
            raise ValueError(f"tp_size {self.tp_size} from rank {self.rank} does not fit a world of {self.world_size}")
        if not isinstance(self.spp_size, int) or self.spp_size < 1:
            raise ValueError(f"spp_size must be a positive integer, got {self.spp_size!r}")
        if self.rank + self.spp_size * self.tp_size > self.world_size:
            raise ValueError(f"{self.spp_size} stages x TP {self.tp_size} from rank {self.rank} exceed a world of "
                             f"{self.world_size}")  # fmt: skip

    @property
    def device(self) -> str:
        """Where the engine runs ("cpu", "cuda", "cuda:N"; `EngineConfig` checked it exists)."""
        return self.engine.device

    @classmethod
    def from_args(cls, role: str, args: argparse.Namespace) -> InstanceConfig:
        engine = engine_config_from_args(args)
        if role == "decode":  # a burst of new batch sizes then never waits on graph captures
            engine = replace(engine, cuda_graphs_at_start=True)
        return cls(
            role,
            args.instance_id,
            args.nats_url,
            args.rank,
            args.world_size,
            args.dist_init,
            engine,
            args.otlp_endpoint,
            getattr(args, "tp_size", 1),
            getattr(args, "node", ""),
            getattr(args, "spp_size", 1),
        )


@dataclass
class Job:
    """One request on this instance until its terminal state."""

    spec: RequestSpec
    span: Span
    started: float = field(default_factory=time.time)
    next_seq: int = 0  # sequence number of the next output token this instance publishes (of choice 0)
    stats: dict[str, float] = field(default_factory=dict)
    choice_seq: dict[int, int] = field(default_factory=dict)  # n > 1: choice i > 0 -> its next sequence number
    choices_done: set[int] = field(default_factory=set)  # n > 1: the choices that finished
    computed: int = 0  # prompt tokens whose KV this instance computed (prefill and elastic instances)

    @property
    def num_output_tokens(self) -> int:
        return self.next_seq + sum(self.choice_seq.values())

    @property
    def request_id(self) -> str:
        return self.spec.request_id


FATAL_CLEANUP_S = 10.0  # after the engine thread died: the most the clean-up (failing jobs, leaving) may take


def exit_within(seconds: float) -> None:
    """Exit the process with status 1 after `seconds` even if the clean-up hangs (a data-plane or thread-pool call
    blocked on a dead peer would otherwise keep a process without an engine alive)."""

    def force() -> None:
        log.error("clean-up did not finish in %.0f s; exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


class Instance:
    def __init__(self, config: InstanceConfig) -> None:
        self.config = config
        self.id = config.instance_id
        self.jobs: dict[str, Job] = {}
        self.aborted: dict[str, float] = {}
        self.started_at = time.time()
        self.engine: Engine
        self.thread: EngineThread
        self.bus: Bus
        self.dp: DataPlane
        self.loop: asyncio.AbstractEventLoop
        self.tracer = tracer(f"spindle.{config.role}")
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle ----

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        setup(f"spindle-{cfg.role}", cfg.otlp_endpoint)
        self.loop = asyncio.get_running_loop()
        if cfg.tp_size > 1:  # a tensor-parallel model names its peers by global rank: join first
            await self._join_data_plane()
        self.thread = EngineThread(self.make_engine, self._outputs_from_thread)
        self.engine = await asyncio.wrap_future(self.thread.start())
        if cfg.tp_size == 1:
            await self._join_data_plane()
        self.bus = await Bus.connect(cfg.nats_url, f"spindle-{self.id}", inject=inject)
        await self.bus.subscribe(subjects.ABORT, Abort, self._on_abort)
        await self.bus.subscribe(subjects.instance_stats(self.id), StatsQuery, self._on_stats)
        await self.serve()
        tasks = [asyncio.create_task(run_heartbeat(self.bus, info)) for info in self.registry_entries()]
        tasks.append(asyncio.create_task(self._sweep_loop()))
        log.info("%s ready (rank %d on %s, %d KV blocks)", self.id, cfg.rank, cfg.device,
                 self.engine.allocator.num_blocks)  # fmt: skip
        try:
            while not stop.is_set():
                if not self.thread.is_alive():
                    log.error("%s: the engine thread died; exiting", self.id)
                    exit_within(FATAL_CLEANUP_S)
                    raise SystemExit(1)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for job in list(self.jobs.values()):
                await self.fail(job, 503, f"{cfg.role} instance {self.id} is shutting down")
            await self.before_engine_stop()
            self.thread.stop()
            await self.bus.close()
            await asyncio.to_thread(self.dp.close)
            shutdown()

    async def _join_data_plane(self) -> None:
        cfg = self.config
        log.info("%s: joining the data plane as rank %d of %d", self.id, cfg.rank, cfg.world_size)
        self.dp = await asyncio.to_thread(DataPlane.init, cfg.rank, cfg.world_size, cfg.dist_init, device=cfg.device)

    def make_engine(self) -> Engine:
        """Build the engine (on the engine thread)."""
        return Engine(self.config.engine)

    async def before_engine_stop(self) -> None:
        """Last engine calls at shutdown (after every job has ended)."""

    async def serve(self) -> None:
        """Subscribe the role's own subjects."""
        raise NotImplementedError

    def on_outputs(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        """Runs on the engine thread after each step."""
        raise NotImplementedError

    def _outputs_from_thread(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        try:
            self.on_outputs(outputs, t0, t1)
        except Exception:
            log.exception("handling engine outputs failed")

    def registry_entries(self) -> list[Callable[[], InstanceInfo | None]]:
        """What this process registers, one heartbeat each (an entry ends when its callable returns None)."""
        return [self.info]

    def kv_bytes_per_token(self) -> int:
        """One token's KV on this instance over every layer of the model (a pipeline stage's cache holds some)."""
        k = self.engine.cache.k  # [layers here, blocks, block_size, kv_heads, head_dim]
        return self.engine.model_config.num_layers * k.shape[3] * k.shape[4] * 2 * k.element_size()

    @functools.cached_property
    def device(self) -> str:
        """Where the engine runs, as its heartbeats report it: "cpu" or "cuda:N" (a bare "cuda" with its index)."""
        return str(check_device(self.config.device))

    def info(self) -> InstanceInfo:
        snap = self.thread.snapshot
        return InstanceInfo(
            instance_id=self.id,
            role=self.config.role,
            rank=self.config.rank,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            kv_blocks_total=snap.num_blocks,
            kv_blocks_used=snap.num_used_blocks,
            block_size=self.engine.config.block_size,
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            queued_tokens=snap.waiting_tokens,
            max_model_len=self.engine.max_model_len,
            node=self.config.node or socket.gethostname(),
            tp_size=self.config.tp_size,
            spp_size=self.config.spp_size,
            kv_bytes_per_token=self.kv_bytes_per_token(),
            device=self.device,
        )

    def start_job(self, spec: RequestSpec, raw: Msg, job_type: type[Job] = Job) -> Job | None:
        """The request's job here, its span a child of the command's (None when it already has one, or was
        aborted)."""
        rid = spec.request_id
        if rid in self.jobs or self.is_aborted(rid):
            return None
        span = self.tracer.start_span(self.config.role, context=extract(raw.headers))
        span.set_attribute("spindle.request_id", rid)
        span.set_attribute("spindle.instance", self.id)
        job = self.jobs[rid] = job_type(spec, span)
        return job

    # ---- engine access ----

    async def call(self, fn: Any) -> Any:
        """Run `fn(engine)` on the engine thread."""
        return await asyncio.wrap_future(self.thread.call(fn))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `coro` as a task this instance keeps a reference to until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def add_to_engine(self, job: Job, prefill_only: bool, directed: bool = False) -> None:
        """Load `job`'s prompt and queue it in the engine (`directed`: hold it for `Engine.step_directed`); a bad
        prompt or sampling fails it with 400. An abort that arrived while the prompt loaded is honoured (the engine
        would otherwise keep the request).

        Returns once the engine call is queued, not when the engine has run it (at its next step boundary): a
        subscription handles its messages one at a time, so waiting here would let only one new request into
        each step while the engine is busy."""
        rid = job.request_id
        try:
            prompt = await load_prompt(self.bus, job.spec.prompt)
            params = sampling_params(job.spec.sampling)
        except ValueError as e:
            await self.fail(job, 400, str(e))
            return
        if directed:
            added = self.thread.call(lambda e: e.add_directed(rid, prompt, params))
        else:
            added = self.thread.call(lambda e: e.add_request(rid, prompt, params, prefill_only=prefill_only))
        self.spawn(self._added(job, asyncio.wrap_future(added)))

    async def _added(self, job: Job, added: asyncio.Future) -> None:
        rid = job.request_id
        try:
            await added
        except ValueError as e:
            await self.fail(job, 400, str(e))
            return
        if self.is_aborted(rid):
            await self.call(lambda e: e.abort(rid))

    def report_prompt_progress(self, t0: float, t1: float) -> None:
        """On the engine thread, after a step that ran between t0 and t1: `record_chunk` for every request whose
        prompt advanced in this engine."""
        engine = self.engine
        for rid, job in list(self.jobs.items()):
            if job.computed >= job.spec.prompt.num_tokens:
                continue
            seq = engine.requests.get(rid) or engine.held.get(rid)
            if seq is None:
                continue
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if done > job.computed:
                tokens = {"spindle.tokens": done - job.computed}
                self.from_thread(self.record_chunk(job, job.computed, done, t0, t1, tokens))
                job.computed = done

    async def record_chunk(
        self,
        job: Job,
        start: int,
        end: int,
        t0: float,
        t1: float,
        attributes: dict[str, int | str],
        ring_bytes: int = 0,
        rebalance_bytes: int = 0,
    ) -> None:
        """Prompt tokens [start, end) done here between t0 and t1: the trace spans (the queue wait before the
        first chunk, then the chunk) and the progress event."""
        if start == 0:  # the wait on this instance before the first chunk ran
            queued = self.tracer.start_span(
                f"{self.config.role}.queue",
                context=trace.set_span_in_context(job.span),
                start_time=int(job.started * 1e9),
            )
            queued.end(end_time=int(t0 * 1e9))
        span = self.tracer.start_span(
            "prefill.chunk",
            context=trace.set_span_in_context(job.span),
            start_time=int(t0 * 1e9),
            attributes={**attributes, "spindle.token_range": f"{start}:{end}"},
        )
        span.end(end_time=int(t1 * 1e9))
        await self.bus.publish(
            subjects.EVENTS,
            PrefillProgress(
                request_id=job.request_id,
                instance_id=self.id,
                tokens_done=end,
                tokens_total=job.spec.prompt.num_tokens,
                chunk_seconds=t1 - t0,
                ring_bytes=ring_bytes,
                rebalance_bytes=rebalance_bytes,
            ),
        )

    def from_thread(self, coro: Any) -> None:
        """Schedule a coroutine on the event loop from the engine thread."""
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    # ---- terminal states ----

    def is_aborted(self, request_id: str) -> bool:
        return request_id in self.aborted

    async def publish_tokens(
        self,
        job: Job,
        token_ids: list[int],
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        choice: int = 0,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """Output tokens of `choice` (n > 1 requests have several), numbered per choice; `finish_reason` ends
        that choice's stream."""
        # numbered before awaiting, so concurrent publishers keep the numbering
        if choice == 0:
            seq = job.next_seq
            job.next_seq += len(token_ids)
        else:
            seq = job.choice_seq.get(choice, 0)
            job.choice_seq[choice] = seq + len(token_ids)
        await self.bus.publish(
            subjects.stream(job.request_id),
            StreamEvent(
                request_id=job.request_id,
                index=choice,
                seq=seq,
                token_ids=token_ids,
                finished=finish_reason is not None,
                finish_reason=finish_reason,
                stats=job.stats if finish_reason is not None else None,
                logprobs=wire_logprobs(logprobs),
                prompt_logprobs=wire_logprobs(prompt_logprobs),
            ),
        )

    async def finish(
        self,
        job: Job,
        token_ids: list[int],
        finish_reason: str,
        logprobs: list[TokenLogprobs] | None = None,
        choice: int = 0,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """The last tokens of `choice`; the request ends when its last choice does."""
        if self.jobs.get(job.request_id) is not job:
            return
        job.choices_done.add(choice)
        if len(job.choices_done) < job.spec.sampling.n:
            await self.publish_tokens(job, token_ids, finish_reason, logprobs, choice)
            return
        del self.jobs[job.request_id]
        await self.publish_tokens(job, token_ids, finish_reason, logprobs, choice, prompt_logprobs)
        await self.bus.publish(
            subjects.EVENTS,
            RequestFinished(
                request_id=job.request_id,
                instance_id=self.id,
                finish_reason=finish_reason,
                num_output_tokens=job.num_output_tokens,
            ),
        )
        job.span.set_attribute("spindle.finish_reason", finish_reason)
        job.span.end()

    async def fail(self, job: Job, status: int, message: str) -> None:
        """End `job` with an error everywhere: free here, tell the gateway and the scheduler."""
        if self.jobs.pop(job.request_id, None) is None:
            return
        log.warning("%s: request %s failed: %s", self.id, job.request_id, message)
        with contextlib.suppress(Exception):
            await self.call(lambda e: e.abort(job.request_id))
        await self.bus.publish(
            subjects.stream(job.request_id),
            StreamEvent(request_id=job.request_id, seq=job.next_seq, error=message, status=status),
        )
        await self.bus.publish(
            subjects.EVENTS,
            RequestFailed(request_id=job.request_id, instance_id=self.id, message=message, status=status),
        )
        await self.bus.publish(subjects.ABORT, Abort(request_id=job.request_id, reason=message))
        job.span.set_attribute("spindle.error", message)
        job.span.end()

    async def on_abort_job(self, request_id: str) -> None:
        """Role-specific clean-up of an aborted request (cancel receives, drop parked entries)."""

    async def _on_abort(self, msg: Abort, raw: Msg) -> None:
        rid = msg.request_id
        self.aborted[rid] = time.time()
        await self.on_abort_job(rid)
        job = self.jobs.pop(rid, None)
        await self.call(lambda e: e.abort(rid))
        if job is not None:
            job.span.set_attribute("spindle.aborted", msg.reason)
            job.span.end()

    async def _on_stats(self, msg: StatsQuery, raw: Msg) -> InstanceStats:
        """Answered from the engine thread's last snapshot, so a long step never delays it."""
        snap = self.thread.snapshot
        return InstanceStats(
            instance_id=self.id,
            role=self.config.role,
            kv_blocks_total=snap.num_blocks,
            kv_blocks_used=snap.num_used_blocks,
            requests=self.blocks_held(),
            counters=self.path_counters(),
        )

    def path_counters(self) -> dict[str, int]:
        """`dataplane_<transport>_peers`: the peers this rank reaches by each transport other than plain gloo (the
        CPU stack's only one, so a CPU instance reports none), e.g. `dataplane_host_staged_peers` on a GPU."""
        counts: dict[str, int] = {}
        for path in self.dp.paths().values():
            if path != "gloo":
                key = f"dataplane_{path.replace('-', '_')}_peers"
                counts[key] = counts.get(key, 0) + 1
        return counts

    def blocks_held(self) -> dict[str, int]:
        """What `InstanceStats.requests` reports: blocks per request id."""
        return dict(self.thread.snapshot.blocks_held)

    async def _sweep_loop(self) -> None:
        """Forget old aborts; drop requests well past their deadline (the gateway has ended them)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for rid, t in list(self.aborted.items()):
                if now - t > ABORT_MEMORY_S:
                    del self.aborted[rid]
            for job in list(self.jobs.values()):
                if now > job.spec.deadline + DEADLINE_GRACE_S:
                    await self.fail(job, 504, "deadline exceeded")
