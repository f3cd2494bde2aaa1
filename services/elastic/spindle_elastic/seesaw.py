"""A re-sharding elastic instance: a Seesaw group (`python -m spindle_elastic --reshard PP2:TP2`, seed 004).

This process leads N = the plan's processes (the others: `python -m spindle_elastic.reshard_member`) through
`spindle_engine.reshard.group.ReshardingEngine`. At start it publishes the model's weights once to shared host
memory; every switch rebuilds every rank's shard from there. It registers twice: as the elastic instance (its
current configuration in `parallel`, its plan in `reshard_plan`) and as its host KV tier, a kvstore `<id>-host`
whose room is the tier's (one block per token).

What the scheduler (the `seesaw` strategy, `transition` schedule) sends and what it does:
- `RunIteration` with whole prompts offloaded to its tier: one pipeline step; each stage writes its layers of each
  prompt's KV to the tier while the next stage computes; the first token streams; `PrefillDone` and
  `TransferDone(parked=True)` (the KV is in the tier, the group's blocks are free).
- `ReshardInstance(to)`: the switch (its requests are all in the tier then); `Resharded` with the measured time and
  weight bytes; a `reshard` span in the trace.
- `MigrateKVIn` from its tier: onboarding (every rank reads its heads); `KVMigrated`, `DecodeStarted`.
- `RunIteration` of decodes: one tensor-parallel step of every onboarded request.
- `MigrateKVIn` on its tier's subject: a decode goes back to the tier before the switch back (`KVMigrated`).
Anything else (a prefill in a tensor-parallel configuration, a chunk, a decode in a pipeline one) fails its
requests with a clear error: the strategy's other schedules run in `spindle sim` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace

import msgspec
from nats.aio.msg import Msg

from spindle_engine import StepOutput
from spindle_engine.kv_cache import KVCache
from spindle_engine.reshard import HostWeights, ReshardPlan
from spindle_engine.reshard.group import ReshardingEngine, group_engine_config, label
from spindle_engine.reshard.tier import HostTier, tier_dir, weights_path
from spindle_model import load_state_dict, resolve_model
from spindle_protocol import subjects
from spindle_protocol.messages import (
    DecodeStarted,
    InstanceInfo,
    InstanceStats,
    IterationDone,
    KVMigrated,
    MigrateKVIn,
    PrefillDone,
    Resharded,
    ReshardInstance,
    RunIteration,
    StatsQuery,
    TransferDone,
)
from spindle_protocol.prompts import load_prompt
from spindle_telemetry import extract
from spindle_worker import Instance, InstanceConfig, sampling_params

log = logging.getLogger("spindle.elastic.seesaw")

DEFAULT_HOST_KV_GB = 2.0


class SeesawGroup(Instance):
    def __init__(self, config: InstanceConfig, plan: ReshardPlan, host_kv_tokens: int | None, host_kv_gb: float,
                 tier_root: str = "") -> None:  # fmt: skip
        super().__init__(config)
        self.plan = plan
        self.host_kv_tokens, self.host_kv_gb, self.tier_root = host_kv_tokens, host_kv_gb, tier_root
        self.tier_id = f"{self.id}-host"
        self.group: ReshardingEngine

    def make_engine(self) -> ReshardingEngine:  # type: ignore[override]
        cfg = self.config.engine
        source = resolve_model(cfg.model)
        model = source.config
        engine = group_engine_config(cfg, model, self.plan)
        directory = tier_dir(self.id, self.tier_root)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.kv"):  # a previous run's, killed before it cleaned up
            stale.unlink(missing_ok=True)
        t0 = time.perf_counter()
        weights = HostWeights.publish(
            load_state_dict(source.path, dtype=cfg.torch_dtype), weights_path(self.id, self.tier_root)
        )
        log.info("%s: weights published to host memory (%.1f MiB, %.2f s)", self.id, weights.nbytes / (1 << 20),
                 time.perf_counter() - t0)  # fmt: skip
        per_token = KVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, cfg.torch_dtype)
        tokens = self.host_kv_tokens or int(self.host_kv_gb * (1 << 30)) // per_token
        self.group = ReshardingEngine(engine, model, self.plan, self.config.rank, weights,
                                      HostTier(directory, model, cfg.torch_dtype, tokens))  # fmt: skip
        log.info("%s: a %s group of ranks %d-%d, host KV tier of %d tokens in %s", self.id, self.plan.label(),
                 self.config.rank, self.config.rank + self.plan.world - 1, tokens, directory)  # fmt: skip
        return self.group

    async def before_engine_stop(self) -> None:
        if self.thread.is_alive():
            try:
                await self.call(lambda g: g.close())
            except Exception as e:  # the members may be gone already
                log.warning("%s: closing the group: %s", self.id, e)
        HostWeights.remove(weights_path(self.id, self.tier_root))
        try:
            os.rmdir(tier_dir(self.id, self.tier_root))
        except OSError as e:
            log.warning("%s: the tier directory stays: %s", self.id, e)

    async def serve(self) -> None:
        # one subscription runs its handler a message at a time; the strategy sends a group's next iteration or
        # switch only after the last one's answer; onboardings overlap the decode iterations (their reads run on the
        # prefetchers) and meet them only on the engine thread, one call at a time
        await self.bus.subscribe(subjects.elastic_iteration(self.id), RunIteration, self._on_iteration)
        await self.bus.subscribe(subjects.elastic_reshard(self.id), ReshardInstance, self._on_reshard)
        await self.bus.subscribe(subjects.elastic_migrate_in(self.id), MigrateKVIn, self._on_onboard)
        await self.bus.subscribe(subjects.elastic_migrate_in(self.tier_id), MigrateKVIn, self._on_park)
        await self.bus.subscribe(subjects.instance_stats(self.tier_id), StatsQuery, self._on_tier_stats)

    # ---- registration ----

    def registry_entries(self) -> list[Callable[[], InstanceInfo | None]]:
        return [self.info, self.tier_info]

    def info(self) -> InstanceInfo:
        """From the engine thread's snapshot and the group's fixed sizes (never the engine itself: it is rebuilt
        during a switch)."""
        snap, par, g = self.thread.snapshot, self.group.parallel, self.group
        return InstanceInfo(
            instance_id=self.id, role=self.config.role, rank=self.config.rank, pid=os.getpid(),
            started_at=self.started_at, updated_at=time.time(), kv_blocks_total=snap.num_blocks,
            kv_blocks_used=snap.num_used_blocks, block_size=g.config.block_size, num_running=snap.num_running,
            num_waiting=snap.num_waiting, max_model_len=g.max_model_len, node=self.node, tp_size=par.tp,
            spp_size=par.pp, kv_bytes_per_token=g.tier.bytes_per_token(), parallel=label(par),
            reshard_plan=f"{label(self.plan.prefill)}:{label(self.plan.decode)}", device=self.device,
        )  # fmt: skip

    def tier_info(self) -> InstanceInfo:
        """The host tier as a kvstore of one-token blocks."""
        tier = self.group.tier
        per_token = tier.bytes_per_token()
        return InstanceInfo(
            instance_id=self.tier_id, role="kvstore", rank=self.config.rank, pid=os.getpid(),
            started_at=self.started_at, updated_at=time.time(), kv_blocks_total=tier.capacity_tokens,
            kv_blocks_used=tier.used_tokens, block_size=1, kv_bytes_total=tier.capacity_tokens * per_token,
            kv_bytes_used=tier.used_tokens * per_token, node=self.node, device="cpu",  # the tier is host memory
        )  # fmt: skip

    async def _on_stats(self, msg: StatsQuery, raw: Msg) -> InstanceStats:
        """With the group's counters: switches, what moved through the tier, the leader's seconds (in ms)."""
        stats = await super()._on_stats(msg, raw)
        g = self.group
        counters = {**stats.counters, "reshards": len(g.switches) - 1, "tier_bytes_in": g.tier.bytes_in}
        counters |= {"tier_bytes_out": g.tier.bytes_out, **g.counts}
        counters |= {f"{k}_ms": int(v * 1e3) for k, v in g.seconds.items()}
        counters["reshard_ms"] = int(sum(s.seconds for s in g.switches[1:]) * 1e3)
        busy, exposed = g.prefetch_seconds()
        counters |= {"prefetch_read_ms": int(busy * 1e3), "prefetch_exposed_ms": int(exposed * 1e3)}
        return msgspec.structs.replace(stats, counters=counters)

    async def _on_tier_stats(self, msg: StatsQuery, raw: Msg) -> InstanceStats:
        """The tier's requests and the tokens each holds (read between the engine thread's changes)."""
        tier = self.group.tier
        held: dict[str, int] = {}
        for _ in range(10):
            try:
                held = {rid: e.capacity for rid, e in list(tier.entries.items())}
                held |= {rid: n for rid, (_, n) in list(tier.reserved.items())}
                break
            except RuntimeError:  # changed while read
                await asyncio.sleep(0.01)
        return InstanceStats(instance_id=self.tier_id, role="kvstore", kv_blocks_total=tier.capacity_tokens,
                             kv_blocks_used=sum(held.values()), requests=held)  # fmt: skip

    @property
    def node(self) -> str:
        return self.config.node or socket.gethostname()

    def on_outputs(self, outputs: list[StepOutput], t0: float, t1: float) -> None:
        """The group's own steps are keepalives: every computing step is the scheduler's (directed)."""

    # ---- the scheduler's commands ----

    async def _on_iteration(self, cmd: RunIteration, raw: Msg) -> None:
        t0 = time.perf_counter()
        if cmd.prefills:
            await self._prefill(cmd, raw)
        elif cmd.decodes:
            await self._decode(cmd)
        done = IterationDone(instance_id=self.id, batch_id=cmd.batch_id, seconds=time.perf_counter() - t0)
        await self.bus.publish(subjects.EVENTS, done)

    async def _prefill(self, cmd: RunIteration, raw: Msg) -> None:
        jobs = [j for p in cmd.prefills if (j := self.start_job(p.request, raw)) is not None]
        whole = all(p.start == 0 and p.end == p.request.prompt.num_tokens for p in cmd.prefills)
        to_tier = cmd.offload == self.tier_id and all([s.instance for s in p.retain] == [self.tier_id]
                                                      for p in cmd.prefills)  # fmt: skip
        if cmd.decodes or not whole or not to_tier:
            for job in jobs:
                await self.fail(job, 500, f"a Seesaw group runs whole prompts into its host tier ({self.tier_id}) "
                                "without decodes in the same iteration; the other seesaw schedules run in "
                                "`spindle sim` only")  # fmt: skip
            return
        items = []
        for job in jobs:
            try:
                items.append((job, await load_prompt(self.bus, job.spec.prompt), sampling_params(job.spec.sampling)))
            except ValueError as e:
                await self.fail(job, 400, str(e))
        items = [(j, ids, params) for j, ids, params in items if not self.is_aborted(j.request_id)]
        if not items:
            return
        t0 = time.time()
        try:
            outputs = await self.call(lambda g: g.prefill_to_tier([(j.request_id, ids, p) for j, ids, p in items]))
        except ValueError as e:  # no room in the tier or the cache: the plan does not fit
            for job, _, _ in items:
                await self.fail(job, 503, f"prefill on {self.id}: {e}")
            return
        t1 = time.time()
        kv_bytes = self.group.tier.bytes_per_token()
        for job, ids, _ in items:
            await self.record_chunk(job, 0, len(ids), t0, t1, {"spindle.tokens": len(ids),
                                                               "spindle.parallel": self.group.label})  # fmt: skip
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            job.stats["prefill_ms"] = (t1 - job.started) * 1e3
            done = PrefillDone(request_id=job.request_id, instance_id=self.id, seconds=t1 - job.started,
                               finished=out.finished)  # fmt: skip
            if out.finished:
                await self.bus.publish(subjects.EVENTS, done)
                await self.finish(job, out.new_token_ids, out.finish_reason or "stop", out.logprobs)
                continue
            await self.publish_tokens(job, out.new_token_ids, None, out.logprobs)
            await self.bus.publish(subjects.EVENTS, done)
            n = job.spec.prompt.num_tokens
            parked = TransferDone(request_id=job.request_id, src_instance=self.id, dst_instance=self.tier_id,
                                  nbytes=n * kv_bytes, seconds=t1 - t0, parked=True)  # fmt: skip
            await self.bus.publish(subjects.EVENTS, parked)

    async def _decode(self, cmd: RunIteration) -> None:
        try:
            outputs = await self.call(lambda g: g.decode_step())
        except ValueError as e:
            for d in cmd.decodes:
                if (job := self.jobs.get(d.request_id)) is not None:
                    await self.fail(job, 500, f"decode on {self.id}: {e}")
            return
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if out.finished:
                job.stats["decode_ms"] = (time.time() - job.started) * 1e3 - job.stats.get("prefill_ms", 0.0)
                await self.finish(job, out.new_token_ids, out.finish_reason or "stop", out.logprobs)
            else:
                await self.publish_tokens(job, out.new_token_ids, None, out.logprobs)

    async def _on_reshard(self, cmd: ReshardInstance, raw: Msg) -> None:
        before = self.group.label
        span = self.tracer.start_span("reshard", context=extract(raw.headers))
        span.set_attribute("spindle.instance", self.id)
        span.set_attribute("spindle.reshard.from", before)
        span.set_attribute("spindle.reshard.to", cmd.to)
        to = next((p for p in (self.plan.prefill, self.plan.decode) if label(p) == cmd.to), None)
        if to is None:
            span.end()
            log.error("%s: asked to re-shard to %s, not one of %s", self.id, cmd.to, self.plan.label())
            return
        try:
            switch = await self.call(lambda g: g.switch(to))
        except ValueError as e:  # requests still on the group (the strategy sends them to the tier first): they end
            log.error("%s: re-sharding to %s with requests on the group: %s; failing them", self.id, cmd.to, e)
            span.set_attribute("spindle.error", str(e))
            held = await self.call(lambda g: [*g.current.requests, *g.current.directed, *g.current.reserved])
            for rid in held:
                await self._fail_request(rid, 500, f"{rid} was on {self.id} when it had to re-shard to {cmd.to}")
            switch = await self.call(lambda g: g.switch(to))
        span.set_attribute("spindle.reshard.seconds", switch.seconds)
        span.set_attribute("spindle.reshard.weight_bytes", switch.weight_bytes)
        span.end()
        done = Resharded(instance_id=self.id, config=switch.to, seconds=switch.seconds,
                         weight_bytes=switch.weight_bytes, kv_bytes=0)  # fmt: skip
        await self.bus.publish(subjects.EVENTS, done)

    async def _on_onboard(self, cmd: MigrateKVIn, raw: Msg) -> None:
        rid, t0 = cmd.request_id, time.perf_counter()
        if cmd.src != self.tier_id:
            await self._fail_request(rid, 500, f"a Seesaw group onboards from its own tier {self.tier_id}, not "
                                     f"{cmd.src}")  # fmt: skip
            return
        try:
            read = await self.call(lambda g: g.prefetch(rid))  # the group decodes on while the ranks read
            await asyncio.wrap_future(read)
            entry = await self.call(lambda g: g.onboard(rid))
        except Exception as e:  # not in the tier (aborted meanwhile), no room, a read that failed
            await self._fail_request(rid, 503, f"onboarding {rid} on {self.id}: {e}")
            return
        n = len(entry.token_ids) - 1
        moved = KVMigrated(request_id=rid, instance_id=self.tier_id, dst=self.id, num_tokens=n,
                           seconds=time.perf_counter() - t0)  # fmt: skip
        await self.bus.publish(subjects.EVENTS, moved)
        await self.bus.publish(subjects.EVENTS, DecodeStarted(request_id=rid, instance_id=self.id))

    async def _on_park(self, cmd: MigrateKVIn, raw: Msg) -> None:
        rid, t0 = cmd.request_id, time.perf_counter()
        try:
            entry = await self.call(lambda g: g.park(rid))
        except ValueError as e:
            await self._fail_request(rid, 503, f"parking {rid} in {self.tier_id}: {e}")
            return
        moved = KVMigrated(request_id=rid, instance_id=self.id, dst=self.tier_id, num_tokens=entry.capacity,
                           seconds=time.perf_counter() - t0)  # fmt: skip
        await self.bus.publish(subjects.EVENTS, moved)

    # ---- jobs ----

    async def _fail_request(self, rid: str, status: int, message: str) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            await self.fail(job, status, message)
        else:  # aborted meanwhile: nothing of it is left here
            log.info("%s: %s", self.id, message)


def seesaw_config(config: InstanceConfig, plan: ReshardPlan) -> InstanceConfig:
    """The leader's instance configuration: its group's ranks join the data plane before the model is built."""
    return replace(config, tp_size=plan.world)
