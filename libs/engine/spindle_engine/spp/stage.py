"""The later stages of a sequence-pipeline-parallel engine: each holds a layer range and its KV, nothing else.

A stage keeps no request state. Every step arrives from the previous stage as a `StageStep` (positions and block
tables chosen by the leader's scheduler) with the previous stage's hidden states; the stage runs its layers over
them, writing its layers' KV into its own paged cache at the leader's slots (every stage's cache has the leader's
block count, so one block table serves all), and passes its output on, or, as the last stage, returns the rows
the leader samples from. Blocks the leader frees are simply overwritten later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from spindle_model import LlamaModel, ModelConfig
from spindle_model.parallel import shard_range

from ..kv_cache import KVCache
from ..model_runner import attention_context
from .wire import SPPError, post_return, post_step, recv_hidden, recv_step, wait_posted

log = logging.getLogger("spindle.engine.spp")

LEADER_SILENCE_S = 120.0  # a stage that hears nothing for this long gives up (the leader keeps connections warm)
SEND_TIMEOUT_S = 300.0  # the next stage takes a step within this (it may be busy with the ones before)


def stage_layers(num_layers: int, spp: int, stage: int) -> tuple[int, int]:
    """The layer range `[start, end)` of pipeline stage `stage` of `spp` (earlier stages take one more)."""
    if not 1 <= spp <= num_layers:
        raise ValueError(f"{spp} pipeline stages do not fit a model of {num_layers} layers")
    if not 0 <= stage < spp:
        raise ValueError(f"stage {stage} is not one of {spp}")
    return shard_range(num_layers, spp, stage)


@dataclass
class StageStats:
    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # time in this stage's layers
    wait_s: float = 0.0  # time waiting for the previous stage
    bytes_in: int = 0
    bytes_out: int = 0
    step_spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each step's compute


class PipelineStage:
    """Stage `stage` (> 0) of an SPP engine at `ranks[stage]`; `serve()` runs steps until the leader stops it."""

    def __init__(
        self,
        model: LlamaModel,
        ranks: tuple[int, ...],
        stage: int,
        *,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "torch",
        timeout_s: float = LEADER_SILENCE_S,
    ) -> None:
        if not 0 < stage < len(ranks):
            raise ValueError(f"stage {stage} is not a later stage of {len(ranks)}")
        if model.layer_range != stage_layers(model.config.num_layers, len(ranks), stage):
            raise ValueError(f"stage {stage} needs layers {stage_layers(model.config.num_layers, len(ranks), stage)}")
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.ranks = ranks
        self.stage = stage
        self.is_last = stage == len(ranks) - 1
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attention_backend = attention_backend
        self.timeout_s = timeout_s
        self.cache = KVCache(
            len(model.layers), num_blocks, block_size, model.num_local_kv_heads, self.config.head_dim, model.dtype,
            model.device,
        )  # fmt: skip
        self.stats = StageStats()
        self.record_spans = False

    @torch.inference_mode()
    def serve(self) -> None:
        prev = self.ranks[self.stage - 1]
        nxt = None if self.is_last else self.ranks[self.stage + 1]
        pending: list = []  # sends of earlier steps still on the wire
        elem = self.model.dtype.itemsize
        while True:
            t0 = time.time()
            step = recv_step(prev, self.timeout_s)
            # a malformed step raises ValueError here, before the cache is touched
            batch = step.batch(self.block_size, self.num_blocks) if not step.stop else None
            hidden = None
            if step.num_tokens:
                hidden = recv_hidden(prev, step.num_tokens, self.config.hidden_size, self.model.dtype, self.timeout_s)
                self.stats.bytes_in += hidden.numel() * elem
            t1 = time.time()
            self.stats.wait_s += t1 - t0
            if step.stop:
                if nxt is not None:
                    wait_posted(post_step(step, None, nxt), SEND_TIMEOUT_S, f"stop to rank {nxt}")
                wait_posted(pending, SEND_TIMEOUT_S, "the last sends")
                return
            out = None
            if hidden is not None:
                ctx = attention_context(self.cache, self.model.layer_range[0], self.attention_backend, batch)
                positions = torch.tensor(batch.positions, dtype=torch.long, device=self.model.device)
                out = self.model(positions, ctx, hidden=hidden.to(self.model.device))  # [T, H]
                t2 = time.time()
                self.stats.busy_s += t2 - t1
                self.stats.steps += 1
                self.stats.tokens += step.num_tokens
                if self.record_spans:
                    self.stats.step_spans.append((t1, t2))
            wait_posted(pending, SEND_TIMEOUT_S, f"step {step.seq - 1} to the next stage")
            pending = []  # a gloo send waited for twice waits for a completion that never comes
            if nxt is not None:
                pending = post_step(step, out, nxt)
                self.stats.bytes_out += 0 if out is None else out.numel() * elem
            elif step.return_rows:
                assert out is not None
                rows = out[torch.tensor(step.return_rows, dtype=torch.long, device=out.device)].cpu()
                pending = [post_return(rows, self.ranks[0])]
                self.stats.bytes_out += rows.numel() * elem


def serve_stage(stage: PipelineStage) -> None:
    """`stage.serve()`, logging how it ended; SPPError (a dead or silent peer) is re-raised for the caller."""
    try:
        stage.serve()
    except SPPError:
        log.exception("pipeline stage %d stopped", stage.stage)
        raise
    log.info(
        "pipeline stage %d done: %d steps, %d tokens, busy %.2fs, waiting %.2fs",
        stage.stage, stage.stats.steps, stage.stats.tokens, stage.stats.busy_s, stage.stats.wait_s,
    )  # fmt: skip
