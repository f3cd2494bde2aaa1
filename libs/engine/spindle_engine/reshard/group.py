"""A re-sharding group as the services run it (Seesaw §4.1, §5.2): N processes that hold the model as a pipeline
for prefill (`c_p`, e.g. PP2) and tensor-parallel for decode (`c_d`, e.g. TP2), switching on command.

The leader (the group's first rank) drives it through `ReshardingEngine`, which stands in for an `Engine` on the
service's engine thread: it delegates to the current configuration's leader engine (`SPPLeaderEngine` in a
pipeline, `TPLeaderEngine` in tensor parallelism) and adds Seesaw's operations:
- `prefill_to_tier`: prompts computed by the pipeline as directed steps, every stage writing its layers of each
  prompt's KV to the group's host tier (`tier.py`) while the later stages compute; the first token is sampled, the
  group's blocks free, the request waits in the tier.
- `onboard`: in tensor parallelism, each rank reads its heads of a request's KV from the tier (the followers at the
  next exchange) and the request decodes; `park` is the way back (each rank writes its heads, the request leaves
  the batch), for the decodes still running when the group switches back to prefill.
- `decode_step`: one tensor-parallel step of every onboarded request (the scheduler names each iteration).
- `switch`: the current engine stops its members (the pipeline drains), every process rebuilds its shard of the
  new configuration from the weights in shared host memory (`HostWeights`: published once, never re-read from
  disk) and the leader waits until every member is ready. Only an empty group switches: its requests are in the
  tier.

The other processes run `serve_member`: receive the next configuration, build, report ready, serve as a pipeline
stage or a tensor-parallel follower until the leader stops it, and again, until the leader says exit.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG, RankGroup
from spindle_model import LlamaModel, ModelConfig
from spindle_model.parallel import TPShard

from ..config import EngineConfig
from ..control_frames import send_ints, wait_all
from ..engine import Engine, StepOutput
from ..errors import EngineFatal
from ..kv_cache import KVCache
from ..sampling_params import SamplingParams
from ..spp import PipelineLayout, PipelineStage, SPPLeaderEngine
from ..spp.stage import stage_layers
from ..tp.follower import TPFollower
from ..tp.lockstep import TPLeaderEngine
from .config import Parallel, ReshardPlan
from .tier import HostTier, TierEntry, TierPut

log = logging.getLogger("spindle.engine.reshard")

_CONFIG, _READY = RANK_GROUP_TAG + 28672, RANK_GROUP_TAG + 28673
STARTUP_TIMEOUT_S = 600.0  # a member waits this long for its first configuration (the leader loads the model)
SWITCH_TIMEOUT_S = 300.0  # a member rebuilds within this


class ReshardError(EngineFatal):
    """A member died or did not answer during a switch: the group cannot go on."""


def label(par: Parallel) -> str:
    """The scheduler's label of a configuration: `TP2`, `PP2`, `TP2PP2`."""
    return (f"TP{par.tp}" if par.tp > 1 or par.pp == 1 else "") + (f"PP{par.pp}" if par.pp > 1 else "")


def group_engine_config(config: EngineConfig, model: ModelConfig, plan: ReshardPlan) -> EngineConfig:
    """Every member's engine configuration: one KV capacity in tokens for both configurations (what the fullest
    rank of either fits into `kv_cache_memory_gb`, unless `kv_cache_tokens` is given), so the group's room does not
    change with a switch."""
    plan.check(model.num_layers, model.num_kv_heads)
    config = replace(config, cuda_graphs=False, fused_cpu_decode=False)
    if config.kv_cache_tokens is not None:
        return config
    tokens = []
    for par in (plan.prefill, plan.decode):
        start, end = stage_layers(model.num_layers, par.pp, 0) if par.pp > 1 else (0, model.num_layers)
        heads = TPShard.create(model, 0, par.tp).num_kv_heads  # rank 0 holds the most
        tokens.append(config.kv_tokens(KVCache.bytes_per_token(end - start, heads, model.head_dim, config.torch_dtype)))
    return replace(config, kv_cache_tokens=min(tokens))


def build_shard(
    model: ModelConfig, config: EngineConfig, par: Parallel, first: int, rank: int, weights: Mapping[str, Tensor]
) -> tuple[LlamaModel, Tensor | None]:
    """This rank's shard of configuration `par` (the group's ranks start at `first`), from the host weights; for
    the leader of a pipeline also the lm_head weight `[vocab, H]`."""
    stage, _ = par.position(rank - first)
    ranks = tuple(first + r for r in par.stage_ranks(stage))
    group = RankGroup(ranks) if par.tp > 1 else None
    layers = stage_layers(model.num_layers, par.pp, stage) if par.pp > 1 else (0, model.num_layers)
    shard = LlamaModel(model, dtype=config.torch_dtype, device=config.torch_device, tp_group=group, layer_range=layers)
    shard.load_weights(weights)
    if par.pp == 1 or rank != first:
        return shard.eval(), None
    head = shard.embed_tokens if model.tie_word_embeddings else weights["lm_head.weight"].to(config.torch_device)
    assert head is not None
    return shard.eval(), head


def _bytes(model: LlamaModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _recv_ints(n: int, src: int, tag: int, timeout_s: float, what: str) -> list[int]:
    buf = torch.empty(n, dtype=torch.int64)
    wait_all([p2p.irecv(buf, src, tag=tag)], timeout_s, what, ReshardError)
    return buf.tolist()


@dataclass(frozen=True)
class Switch:
    to: str  # the new configuration's label
    seconds: float  # the leader's view: drain, every rank's rebuild, ready
    weight_bytes: int  # loaded from host memory over every rank


class ReshardingEngine:
    """The leader's side of a re-sharding group (see the module docstring); anything else is the current engine's."""

    def __init__(
        self, config: EngineConfig, model: ModelConfig, plan: ReshardPlan, first_rank: int,
        weights: Mapping[str, Tensor], tier: HostTier,
    ) -> None:  # fmt: skip
        self.config, self.model_config, self.plan = config, model, plan
        self.first, self.weights, self.tier = first_rank, weights, tier
        self.members = tuple(range(first_rank + 1, first_rank + plan.world))
        self.current: Engine | None = None
        self.parallel = plan.prefill
        self.switches: list[Switch] = []
        # what the group moved through its tier, for the instance's stats (the members' own writes are in their logs)
        self.counts = {"prefilled": 0, "onboarded": 0, "parked": 0, "swap_out_steps": 0, "swap_out_hidden_steps": 0}
        self.seconds = {"swap_out": 0.0, "onboard": 0.0, "park": 0.0}  # the leader's side
        self._prefetched = (0.0, 0.0)  # prefetch_seconds of the tensor-parallel engines closed so far
        self.first_load = self.switch(plan.prefill)
        assert self.current is not None
        self.max_model_len = self.current.max_model_len  # the same in every configuration

    def __getattr__(self, name: str) -> object:
        if name == "current":
            raise AttributeError(name)
        return getattr(self.current, name)

    @property
    def label(self) -> str:
        return label(self.parallel)

    # ---- the engine thread's loop ----

    def has_unfinished(self) -> bool:
        """Only the keepalive and calls for the followers: the scheduler names every step (directed)."""
        if isinstance(self.current, TPLeaderEngine):
            return self.current.needs_sync()
        assert self.current is not None
        return self.current.has_unfinished()

    def step(self) -> list[StepOutput]:
        if isinstance(self.current, TPLeaderEngine):
            self.current.sync()
            return []
        assert self.current is not None
        return self.current.step()  # nothing scheduled: the pipeline's keepalive

    # ---- Seesaw's operations ----

    def _pipeline(self) -> SPPLeaderEngine:
        if not isinstance(self.current, SPPLeaderEngine):
            raise ValueError(f"prefill into the host tier runs in a pipeline configuration, not {self.label}")
        return self.current

    def _tp(self) -> TPLeaderEngine:
        if not isinstance(self.current, TPLeaderEngine):
            raise ValueError(f"decode runs in a tensor-parallel configuration, not {self.label}")
        return self.current

    def prefill_to_tier(self, prompts: list[tuple[str, list[int], SamplingParams]]) -> list[StepOutput]:
        """One pipeline step computing these whole prompts; each prompt's KV goes to the tier unless its first token
        ends it. ValueError, and nothing held, when the tier has no room or the step does not fit."""
        engine = self._pipeline()
        runner = engine.runner
        before = (runner.swap_out_s, runner.swap_out_steps, runner.swap_out_hidden_steps)
        taken: list[str] = []  # tier files and engine entries made here (a failure undoes just these)
        try:
            for rid, ids, params in prompts:
                name = self.tier.reserve(rid, len(ids))
                taken.append(rid)
                runner.offload[rid] = (self.tier.dir, name, len(ids))
                engine.add_directed(rid, ids, params)
            outputs = engine.step_directed({rid: len(ids) for rid, ids, _ in prompts}, [])
        except Exception:
            for rid in taken:
                engine.abort(rid)
                self.tier.drop(rid)
            raise
        finally:
            runner.offload.clear()
        self.seconds["swap_out"] += runner.swap_out_s - before[0]
        self.counts["swap_out_steps"] += runner.swap_out_steps - before[1]
        self.counts["swap_out_hidden_steps"] += runner.swap_out_hidden_steps - before[2]
        for out in outputs:
            if out.finished:  # the engine freed it
                self.tier.drop(out.request_id)
                continue
            seq = engine.directed[out.request_id]
            self.tier.landed(out.request_id, seq.token_ids, seq.num_prompt_tokens, seq.params)
            engine.abort(out.request_id)  # its blocks: the KV is in the tier
            self.counts["prefilled"] += 1
        return outputs

    def prefetch(self, request_id: str) -> Future[Tensor]:
        """Start every rank reading its heads of a request's KV from the tier on its prefetcher's thread (Seesaw's
        swap-in, §5.2), while the group keeps decoding; `onboard` then takes them. Returns this rank's read."""
        engine = self._tp()
        entry = self.tier.entries.get(request_id)
        if entry is None:
            raise ValueError(f"{request_id} is not in the host tier")
        put = TierPut(entry.name, [], len(entry.token_ids) - 1, entry.capacity)
        return engine.prefetch_from_tier(request_id, self.tier.dir, put)

    def prefetch_seconds(self) -> tuple[float, float]:
        """(reading on the prefetchers' thread, the onboarding waiting for a read) on this rank so far."""
        busy, exposed = self._prefetched
        if isinstance(self.current, TPLeaderEngine) and self.current.prefetcher is not None:
            busy, exposed = busy + self.current.prefetcher.busy_s, exposed + self.current.prefetcher.exposed_s
        return busy, exposed

    def onboard(self, request_id: str) -> TierEntry:
        """Bring a request from the tier into the tensor-parallel batch (every rank reads its heads, or takes what
        `prefetch` read)."""
        engine, t0 = self._tp(), time.perf_counter()
        entry = self.tier.entries.get(request_id)
        if entry is None:
            raise ValueError(f"{request_id} is not in the host tier")
        n = len(entry.token_ids) - 1
        if not engine.reserve(request_id, n):
            raise ValueError(f"no KV room for {request_id} ({n} tokens) on the group")
        put = TierPut(entry.name, [], n, entry.capacity)
        try:
            engine.resume_from_tier(request_id, entry.token_ids, entry.num_prompt_tokens, entry.params, self.tier.dir,
                                    put)  # fmt: skip
        except Exception:
            engine.cancel_reservation(request_id)
            raise
        engine.sync()  # the followers read theirs before the file goes
        self.counts["onboarded"] += 1
        self.seconds["onboard"] += time.perf_counter() - t0
        return self.tier.taken(request_id)

    def park(self, request_id: str) -> TierEntry:
        """Take a decoding request out of the batch into the tier (every rank writes its heads)."""
        engine, t0 = self._tp(), time.perf_counter()
        seq = engine.requests.get(request_id)
        if seq is None:
            raise ValueError(f"{request_id} is not decoding on the group")
        n = seq.num_computed_tokens
        name = self.tier.reserve(request_id, n)
        try:
            out = engine.park_to_tier(request_id, self.tier.dir, TierPut(name, [], n, n))
        except Exception:
            self.tier.drop(request_id)
            raise
        engine.sync()  # the followers wrote theirs
        self.counts["parked"] += 1
        self.seconds["park"] += time.perf_counter() - t0
        return self.tier.landed(request_id, out.token_ids, out.num_prompt_tokens, out.params)

    def decode_step(self) -> list[StepOutput]:
        """One tensor-parallel step of every request in the batch."""
        return self._tp().step()

    def abort(self, request_id: str) -> bool:
        dropped = self.tier.drop(request_id)
        assert self.current is not None
        return self.current.abort(request_id) or dropped

    # ---- switching ----

    def switch(self, to: Parallel) -> Switch:
        """Stop the members, rebuild every rank as `to` from the host weights, wait until all are ready."""
        if to.world != self.plan.world:
            raise ValueError(f"{label(to)} needs {to.world} processes; the group has {self.plan.world}")
        if self.current is not None and (self.current.requests or self.current.directed or self.current.reserved):
            raise ValueError("the group still holds requests: they go to the host tier before a switch")
        t0 = time.perf_counter()
        if self.current is not None:
            self._prefetched = self.prefetch_seconds()
            self.current.close()  # the pipeline drains / the followers stop
            self.current = None
            gc.collect()
        for m in self.members:
            send_ints([to.pp, to.tp], m, _CONFIG, SWITCH_TIMEOUT_S, f"configuration to rank {m}", ReshardError)
        model, head = build_shard(self.model_config, self.config, to, self.first, self.first, self.weights)
        nbytes = _bytes(model)
        for m in self.members:
            nbytes += _recv_ints(1, m, _READY, SWITCH_TIMEOUT_S, f"rank {m} ready as {label(to)}")[0]
        if to.pp > 1:
            assert head is not None
            layout = PipelineLayout.consecutive(self.first, to.pp, to.tp)
            self.current = SPPLeaderEngine(self.config, model, head, layout)
        else:
            self.current = TPLeaderEngine(self.config, model, RankGroup(tuple(range(self.first, self.first + to.tp))))
        self.parallel = to
        done = Switch(label(to), time.perf_counter() - t0, nbytes)
        self.switches.append(done)
        log.info("re-sharded to %s in %.3f s (%.1f MiB of weights from host memory)", done.to, done.seconds,
                 nbytes / (1 << 20))  # fmt: skip
        return done

    def close(self) -> None:
        """Stop the members for good (best effort) and empty the tier."""
        if self.current is not None:
            self.current.close()
            self.current = None
        for m in self.members:
            try:
                send_ints([0, 0], m, _CONFIG, 5.0, f"exit to rank {m}", ReshardError)
            except ReshardError as e:
                log.warning("%s", e)
        self.tier.close()


def serve_member(
    config: EngineConfig,
    model: ModelConfig,
    first_rank: int,
    rank: int,
    weights: Mapping[str, Tensor] | Callable[[], Mapping[str, Tensor]],
    tier: Path,
) -> None:
    """A member other than the leader: each configuration the leader names, built and served until it stops it.
    `weights` may be a callable that maps them (once the leader's first configuration says they are published)."""
    timeout = STARTUP_TIMEOUT_S
    while True:
        pp, tp = _recv_ints(2, first_rank, _CONFIG, timeout, "the next configuration from the leader")
        if pp == 0:
            log.info("rank %d: the leader closed the group", rank)
            return
        if callable(weights):
            weights = weights()
        par = Parallel(pp, tp)
        shard, _ = build_shard(model, config, par, first_rank, rank, weights)
        send_ints([_bytes(shard)], first_rank, _READY, SWITCH_TIMEOUT_S, "ready to the leader", ReshardError)
        log.info("rank %d: serving as %s", rank, label(par))
        if pp > 1:
            layout = PipelineLayout.consecutive(first_rank, pp, tp)
            num_blocks = config.kv_cache_tokens // config.block_size
            stage = PipelineStage(shard, layout, rank, num_blocks=num_blocks, block_size=config.block_size, tier=tier)
            stage.serve()
            log.info("rank %d: %s phase done: %d steps, busy %.2f s; wrote %.1f MiB to the host tier in %.3f s",
                     rank, label(par), stage.stats.steps, stage.stats.busy_s, stage.swap_out_bytes / (1 << 20),
                     stage.swap_out_s)  # fmt: skip
            del stage
        else:
            follower = TPFollower(Engine(config, model=shard), first_rank, tier=tier)
            follower.serve()
            p = follower.prefetcher
            assert p is not None
            log.info("rank %d: %s phase done: read %.3f s from the host tier on the prefetcher, the resumes waited "
                     "%.3f s for it", rank, label(par), p.busy_s, p.exposed_s)  # fmt: skip
            del follower
        del shard
        gc.collect()
        timeout = SWITCH_TIMEOUT_S
