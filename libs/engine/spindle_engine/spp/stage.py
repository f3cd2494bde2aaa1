"""The members of a sequence-pipeline-parallel engine other than its leader: each holds a layer range (and with
tensor parallelism inside the stage, its heads of it) and that KV, nothing else.

A member keeps no request state. Every step arrives as a `StageStep` (positions and block tables chosen by the
leader's scheduler): a later stage's member gets it from the previous stage's leader with that stage's output hidden
states; a tensor-parallel follower of stage 0 gets it from the engine's leader with the step's token ids. The
member runs its layers (all-reducing with the rest of its stage), writing its KV into its own paged cache at the
leader's slots (every member's cache has the leader's block count, so one block table serves all). A stage's
leader (its first TP rank) passes the output on to every member of the next stage or, in the last stage, returns
the rows the leader samples from. Blocks the leader frees are simply overwritten later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spindle_model import LlamaModel, ModelConfig
from spindle_model.parallel import shard_range

from ..esp.decode import MultiMasterContext
from ..esp.exchange import ESPError, Tags, Waiter
from ..kv_cache import KVCache
from ..model_runner import StepBatch, attention_context
from ..reshard.tier import TierPut, open_kv, push_cache
from .wire import SPPError, StageStep, post_return, post_step, recv_hidden, recv_step, wait_posted

log = logging.getLogger("spindle.engine.spp")

LEADER_SILENCE_S = 120.0  # a stage that hears nothing for this long gives up (the leader keeps connections warm)
SEND_TIMEOUT_S = 300.0  # the next stage takes a step within this (it may be busy with the ones before)


@dataclass(frozen=True)
class PipelineLayout:
    """The ranks of an SPP engine: `stages[s]` are stage s's tensor-parallel ranks, its leader first; the engine's
    leader is stage 0's leader."""

    stages: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = [r for stage in self.stages for r in stage]
        if len(self.stages) < 2 or len({len(st) for st in self.stages}) != 1 or not self.stages[0]:
            raise ValueError(f"a pipeline needs two or more stages of one TP size, got {self.stages}")
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise ValueError(f"pipeline ranks must be distinct and >= 0, got {self.stages}")

    @classmethod
    def consecutive(cls, first: int, spp: int, tp: int = 1) -> PipelineLayout:
        """Stage s at ranks first + s*tp .. first + s*tp + tp - 1."""
        return cls(tuple(tuple(first + s * tp + j for j in range(tp)) for s in range(spp)))

    @property
    def spp(self) -> int:
        return len(self.stages)

    @property
    def tp(self) -> int:
        return len(self.stages[0])

    @property
    def leader(self) -> int:
        return self.stages[0][0]

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, TP index) of `rank`."""
        for s, stage in enumerate(self.stages):
            if rank in stage:
                return s, stage.index(rank)
        raise ValueError(f"rank {rank} is not in the pipeline {self.stages}")


def stage_layers(num_layers: int, spp: int, stage: int) -> tuple[int, int]:
    """The layer range `[start, end)` of pipeline stage `stage` of `spp` (earlier stages take one more)."""
    if not 1 <= spp <= num_layers:
        raise ValueError(f"{spp} pipeline stages do not fit a model of {num_layers} layers")
    if not 0 <= stage < spp:
        raise ValueError(f"stage {stage} is not one of {spp}")
    return shard_range(num_layers, spp, stage)


@dataclass
class PipelineStats:
    """What one member of a pipeline did (the leader's and every stage's)."""

    steps: int = 0
    tokens: int = 0
    steps_not_waited: int = 0  # leader: posted down the pipeline without waiting (sequence pipelining)
    busy_s: float = 0.0  # time in this member's layers
    wait_s: float = 0.0  # stage: waiting for the previous stage; leader: for the last stage's rows
    bytes_in: int = 0
    bytes_out: int = 0
    step_spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each step's compute


class PipelineStage:
    """The member of an SPP engine at `rank` (any but the leader); `serve()` runs steps until the leader stops it."""

    def __init__(
        self,
        model: LlamaModel,
        layout: PipelineLayout,
        rank: int,
        *,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "torch",
        timeout_s: float = LEADER_SILENCE_S,
        tier: Path | None = None,
    ) -> None:
        """`tier`: the group's host-tier directory, for steps that write KV to it (Seesaw's swap-out)."""
        stage, tp_index = layout.position(rank)
        if rank == layout.leader:
            raise ValueError(f"rank {rank} leads the pipeline: it runs SPPLeaderEngine")
        want = stage_layers(model.config.num_layers, layout.spp, stage)
        if model.layer_range != want or model.shard.world != layout.tp:
            raise ValueError(f"rank {rank} (stage {stage}) needs layers {want} at TP {layout.tp}")
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.layout = layout
        self.rank = rank
        self.stage = stage
        self.tp_index = tp_index
        self.is_last = stage == layout.spp - 1
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attention_backend = attention_backend
        self.timeout_s = timeout_s
        self.cache = KVCache(
            len(model.layers), num_blocks, block_size, model.num_local_kv_heads, self.config.head_dim, model.dtype,
            model.device,
        )  # fmt: skip
        self.stats = PipelineStats()
        self.record_spans = False
        self.tier = tier
        self.swap_out_s = 0.0
        self.swap_out_bytes = 0

    @property
    def source(self) -> int:
        """Who sends this member its steps: the engine's leader (stage 0) or the previous stage's leader."""
        return self.layout.leader if self.stage == 0 else self.layout.stages[self.stage - 1][0]

    @property
    def next_ranks(self) -> tuple[int, ...]:
        """Where this member sends its output: the next stage (stage leaders only)."""
        if self.tp_index or self.is_last:
            return ()
        return self.layout.stages[self.stage + 1]

    @torch.inference_mode()
    def serve(self) -> None:
        src, nxt = self.source, self.next_ranks
        pending: list = []  # sends of earlier steps still on the wire
        elem = self.model.dtype.itemsize
        while True:
            t0 = time.time()
            step = recv_step(src, self.timeout_s)
            # a malformed step raises ValueError here, before the cache is touched
            batch = step.batch(self.block_size, self.num_blocks) if not step.stop and step.kvp is None else None
            if step.kvp is not None:
                step.kvp.check(self.num_blocks, self.block_size)
            if step.offload and self.tier is None:
                raise ValueError(f"step {step.seq} writes to a host tier, but this stage has none")
            hidden = None
            if step.num_tokens and self.stage > 0:
                hidden = recv_hidden(src, step.num_tokens, self.config.hidden_size, self.model.dtype, self.timeout_s)
                self.stats.bytes_in += hidden.numel() * elem
            t1 = time.time()
            self.stats.wait_s += t1 - t0
            if step.stop:
                wait_posted(pending, SEND_TIMEOUT_S, "the last sends")
                posted = [p for dst in nxt for p in post_step(step, None, dst)]
                wait_posted(posted, SEND_TIMEOUT_S, f"stop to ranks {nxt}")
                return
            out = None
            if step.kvp is not None or step.num_tokens:
                out = self._multi_master(step, hidden) if step.kvp is not None else self._forward(step, batch, hidden)
                t2 = time.time()
                self.stats.busy_s += t2 - t1
                self.stats.steps += 1
                self.stats.tokens += step.num_tokens
                if self.record_spans:
                    self.stats.step_spans.append((t1, t2))
            wait_posted(pending, SEND_TIMEOUT_S, f"step {step.seq - 1} to the next stage")
            pending = []  # a gloo send waited for twice waits for a completion that never comes
            if nxt:
                forward = step if not step.token_ids else step.without_tokens()
                pending = [p for dst in nxt for p in post_step(forward, out, dst)]
                self.stats.bytes_out += 0 if out is None else out.numel() * elem * len(nxt)
            elif self.is_last and self.tp_index == 0 and step.return_rows:
                assert out is not None
                rows = out[torch.tensor(step.return_rows, dtype=torch.long, device=out.device)].cpu()
                pending = [post_return(rows, self.layout.leader)]
                self.stats.bytes_out += rows.numel() * elem
            if step.offload:  # after passing the step on: the writes overlap the next stages and the leader
                self._push(step.offload)

    def _push(self, puts: list[TierPut]) -> None:
        assert self.tier is not None
        t0 = time.time()
        first, heads = self.model.layer_range[0], self.model.shard.kv_heads
        for put in puts:
            store = open_kv(self.tier, put.name, self.config, put.capacity, self.cache.k.dtype, create=False)
            self.swap_out_bytes += push_cache(store, self.cache, put, first, heads)
        self.swap_out_s += time.time() - t0

    def _forward(self, step: StageStep, batch: StepBatch | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers of a plain step: `[T, H]`."""
        assert batch is not None
        ctx = attention_context(self.cache, self.model.layer_range[0], self.attention_backend, batch)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.model.device)
        if self.stage == 0:  # a TP follower of stage 0 embeds the tokens itself
            if len(step.token_ids) != step.num_tokens:
                raise ValueError(f"step {step.seq}: {len(step.token_ids)} token ids for {step.num_tokens}")
            ids = torch.tensor(step.token_ids, dtype=torch.long, device=self.model.device)
            return self.model(positions, ctx, input_ids=ids)  # [T, H]
        assert hidden is not None
        return self.model(positions, ctx, hidden=hidden.to(self.model.device))  # [T, H]

    def _multi_master(self, step: StageStep, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """This stage's layers of a KV-parallel group's step (Medha's 3D), exchanging with the same stage of the other
        members: their processes are their leaders' ranks plus this stage's index (consecutive pipelines, TP 1)."""
        k = step.kvp
        assert k is not None
        if self.layout.tp > 1:
            raise ValueError("KV parallelism over pipelines with TP inside the stages is not supported")
        peers = [leader + self.stage for leader in k.leaders]
        waiter = Waiter(self.timeout_s)
        new_slots = torch.tensor(k.new_slots, dtype=torch.int64)
        ctx = MultiMasterContext(self.cache, self.model.layer_range[0], self.model.num_local_q_heads, k.me, peers,
                                 k.works(), k.local(self.block_size), new_slots, Tags(k.tag_base), waiter)  # fmt: skip
        try:
            if not k.num_tokens:
                for layer in self.model.layers:
                    ctx.serve_layer(layer.layer_id)
                return None
            assert hidden is not None
            positions = torch.tensor(k.positions, dtype=torch.long, device=self.model.device)
            return self.model(positions, ctx, hidden=hidden.to(self.model.device))  # [T, H]
        except ESPError as e:
            raise SPPError(f"stage {self.stage}: a KV-parallel exchange failed: {e}") from e


def serve_stage(stage: PipelineStage) -> None:
    """`stage.serve()`, logging how it ended; SPPError (a dead or silent peer) is re-raised for the caller."""
    try:
        stage.serve()
    except SPPError:
        log.exception("pipeline rank %d (stage %d) stopped", stage.rank, stage.stage)
        raise
    log.info(
        "pipeline rank %d (stage %d) done: %d steps, %d tokens, busy %.2fs, waiting %.2fs",
        stage.rank, stage.stage, stage.stats.steps, stage.stats.tokens, stage.stats.busy_s, stage.stats.wait_s,
    )  # fmt: skip
