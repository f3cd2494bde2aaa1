"""The leader (stage 0) of a sequence-pipeline-parallel (SPP) engine: Medha's §3.3 on one instance.

`SPPLeaderEngine` is an `Engine` whose model is the first layer range and whose runner (`SPPRunner`) sends each
step down the pipeline (wire.py) instead of running the whole model. It keeps every piece of request state: the
scheduler, the block tables, sampling. The later stages (stage.py) hold only their layers and KV.

What makes it *sequence* pipelining: a step that samples nothing (prefill chunks that do not end a prompt) is not
waited for. The leader posts it to stage 1 and schedules the next step at once, so chunk i+1 of a long prompt
runs through stage 0 while chunk i runs through stage 1, back to back, with no micro-batches to fill. A step that
samples (a prompt's last chunk, decodes) waits for the last stage's final hidden rows, so decode batches pass
every stage in turn. The lm_head runs on the leader (for tied embeddings it is stage 0's embedding matrix), so
what comes back is `[rows, H]`, not logits.

With tensor parallelism inside the stages (`PipelineLayout` of S stages x T ranks: Medha's 2D), the leader is stage
0's first TP rank: it sends the step with its token ids to its stage's TP followers before running its own heads,
and every stage's output goes to every member of the next stage.

A pipeline may be a member of a KV-parallel group (Medha's 3D, `spindle_engine.esp`): the group's multi-master steps
run stage 0's layers here, exchanging with the other members' leaders, and go down the pipeline as a `StageStep`
with a `kvp` part, each stage exchanging with the same stage of the others (`SPPRunner.multi_master_forward`; one
rank per stage).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model
from spindle_model.linear import SmallBatchWeight
from spindle_model.parallel import TPShard

from ..config import EngineConfig
from ..engine import Engine, StepOutput
from ..esp.decode import MultiMasterContext
from ..esp.pipeline import KVPStep
from ..kv_cache import KVCache
from ..model_runner import ModelRunner, StepBatch
from ..reshard.tier import TierPut, open_kv, push_cache
from ..sampling_params import SamplingParams
from .stage import SEND_TIMEOUT_S, PipelineLayout, PipelineStats, stage_layers
from .wire import StageStep, post_step, recv_return, wait_posted

log = logging.getLogger("spindle.engine.spp")

KEEPALIVE_S = 1.0  # an idle leader still sends an empty step this often (the stages notice its death)


def spp_engine_config(config: EngineConfig, model_config: ModelConfig, spp: int, tp: int = 1) -> EngineConfig:
    """`config` for every member of an `spp`-stage engine (TP `tp` inside each stage): the KV capacity fixed in
    tokens, the same on every member (what the largest stage's layers at TP rank 0's heads fit into
    `kv_cache_memory_gb`, unless `kv_cache_tokens` is given). The leader turns off CUDA graphs and the fused CPU
    decode itself (both run the whole model)."""
    start, end = stage_layers(model_config.num_layers, spp, 0)  # stage 0 has the most layers
    heads = TPShard.create(model_config, 0, tp).num_kv_heads  # ValueError for a TP size the model cannot split
    if config.kv_cache_tokens is not None:
        return config
    per_token = KVCache.bytes_per_token(end - start, heads, model_config.head_dim, config.torch_dtype)
    return replace(config, kv_cache_tokens=config.kv_tokens(per_token))


def load_stage(
    config: EngineConfig, spp: int, stage: int, tp_ranks: tuple[int, ...] = ()
) -> tuple[LlamaModel, Tensor | None]:
    """Stage `stage`'s layers of `config.model` (this rank's heads of them when `tp_ranks`, the stage's global
    ranks, name two or more: dist must be initialised), and for stage 0 the lm_head weight `[vocab, H]`."""
    source = resolve_model(config.model)
    mc = source.config
    group = RankGroup(tp_ranks) if len(tp_ranks) > 1 else None
    model = LlamaModel(mc, dtype=config.torch_dtype, device=config.torch_device, tp_group=group,
                       layer_range=stage_layers(mc.num_layers, spp, stage))  # fmt: skip
    weights = load_state_dict(source.path, dtype=config.torch_dtype)
    model.load_weights(weights)
    if stage != 0:
        return model, None
    if mc.tie_word_embeddings:
        assert model.embed_tokens is not None
        return model, model.embed_tokens
    return model, weights["lm_head.weight"].to(config.torch_device)


class SPPRunner(ModelRunner):
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        head: Tensor,
        layout: PipelineLayout,
        *,
        attention_backend: str,
        timeout_s: float,
        max_in_flight: int,
    ) -> None:
        super().__init__(model, cache, attention_backend=attention_backend)
        self.head = head  # [vocab, H]
        self._head_small = SmallBatchWeight()
        self.layout = layout
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.seq = 0
        self.in_flight: deque[list] = deque()  # per posted step not yet known to be through: its sends
        self.stats = PipelineStats()
        self.record_spans = False
        self.pipelined = True  # False: wait for every step to pass the last stage (for comparison)
        self.kept_logits: list[Tensor] | None = None  # a list: every sampled row's logits are appended (verify)
        self.last_post = time.monotonic()
        # Seesaw: request -> (tier directory, file, capacity) of prompts whose KV goes to the host tier as the step
        # that completes them runs; set by the caller before the step
        self.offload: dict[str, tuple[Path, str, int]] = {}
        self.swap_out_s = 0.0  # this rank's tier writes
        self.swap_out_bytes = 0
        self.swap_out_steps = self.swap_out_hidden_steps = 0  # hidden: the last stage's rows came after the writes

    def _tier_puts(self, batch: StepBatch) -> list[tuple[Path, TierPut]]:
        puts = []
        for c in batch.ordered:
            seq = c.seq
            if seq.request_id in self.offload and seq.num_computed_tokens + c.num_tokens == seq.num_prompt_tokens:
                directory, name, capacity = self.offload[seq.request_id]
                put = TierPut(name, list(seq.block_table), seq.num_prompt_tokens, capacity)
                puts.append((directory, put))
        return puts

    def _push(self, puts: list[tuple[Path, TierPut]]) -> None:
        t0 = time.time()
        first, heads = self.model.layer_range[0], self.model.shard.kv_heads
        for directory, put in puts:
            store = open_kv(directory, put.name, self.model.config, put.capacity, self.cache.k.dtype, create=False)
            self.swap_out_bytes += push_cache(store, self.cache, put, first, heads)
        self.swap_out_s += time.time() - t0

    def forward(self, batch: StepBatch, rows: list[int] | None) -> Tensor:
        want = list(range(batch.num_tokens)) if rows is None else rows
        puts = self._tier_puts(batch) if self.offload else []
        if puts and not want:
            want = [0]  # wait for the last stage: its tier writes are done when its rows are back
        if not want and not self.pipelined:
            want = [0]  # a row nobody reads: the step is waited for like one that samples
        step = StageStep.of(self.seq, batch, want)
        if puts:
            step = msgspec.structs.replace(step, offload=[p for _, p in puts])
        followers = self.layout.stages[0][1:]
        with_ids = step.with_tokens(batch.token_ids) if followers else step
        sent = [p for f in followers for p in post_step(with_ids, None, f)]  # before the all-reduces need them
        t0 = time.time()
        hidden = super().forward(batch, None)  # [T, H]: stage 0's output
        self._track(sent + [p for dst in self.layout.stages[1] for p in post_step(step, hidden, dst)])
        if puts:  # while the next stages compute
            self._push(puts)
        t1 = time.time()
        self.stats.steps += 1
        self.stats.busy_s += t1 - t0
        self.stats.bytes_out += hidden.numel() * hidden.element_size() * self.layout.tp
        if self.record_spans:
            self.stats.step_spans.append((t0, t1))
        if not want:
            self.stats.steps_not_waited += 1
            return hidden.new_empty(0, hidden.shape[1])
        last = self.layout.stages[-1][0]
        back = recv_return(last, len(want), hidden.shape[1], hidden.dtype, self.timeout_s)
        self._drain()  # the last stage answered this step, so every send before it is through
        self.stats.wait_s += time.time() - t1
        if puts:
            self.swap_out_steps += 1
            self.swap_out_hidden_steps += time.time() - t1 > 1e-3  # still waited after the writes
        return back.to(self.device) if rows is None or rows else back[:0].to(self.device)

    def multi_master_forward(self, ctx: MultiMasterContext, kvp: KVPStep, ids: list[int], rows: list[int]) -> Tensor:
        """A KV-parallel group's multi-master step (Medha's 3D): stage 0's layers here with `ctx` (the exchanges with
        the other members' leaders), then down the pipeline, each stage exchanging with its peers; returns the last
        stage's final rows `rows` (of the tokens this member masters) `[len(rows), H]`, waiting only when there are
        any."""
        if self.layout.tp > 1:
            raise ValueError("KV parallelism over pipelines with TP inside the stages is not supported")
        t0 = time.time()
        hidden = None
        if kvp.num_tokens:
            positions = torch.tensor(kvp.positions, dtype=torch.long, device=self.device)
            hidden = self.model(positions, ctx, input_ids=torch.tensor(ids, dtype=torch.long, device=self.device))
        else:
            for layer in self.model.layers:
                ctx.serve_layer(layer.layer_id)
        t1 = time.time()
        step = StageStep(self.seq, [], [], [], list(rows), kvp=kvp)
        self._track([p for dst in self.layout.stages[1] for p in post_step(step, hidden, dst)])
        self.stats.steps += 1
        self.stats.busy_s += t1 - t0
        size = self.model.config.hidden_size
        if not rows:
            self.stats.steps_not_waited += 1
            return torch.empty(0, size, dtype=self.model.dtype, device=self.device)
        back = recv_return(self.layout.stages[-1][0], len(rows), size, self.model.dtype, self.timeout_s)
        self._drain()
        self.stats.wait_s += time.time() - t1
        return back.to(self.device)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self._head_small.linear(hidden, self.head, torch.float32)
        if logits is None:
            logits = F.linear(hidden, self.head).float()
        if self.kept_logits is not None:
            self.kept_logits.append(logits.detach().cpu().clone())
        return logits

    def keepalive(self) -> None:
        self._post_empty(StageStep(self.seq, [], [], [], []))

    def stop(self) -> None:
        """Stop every member (the stages' leaders forward it down the pipeline) and wait for the sends."""
        self._post_empty(StageStep(self.seq, [], [], [], [], stop=True))
        self._drain()

    def _post_empty(self, step: StageStep) -> None:
        dsts = (*self.layout.stages[0][1:], *self.layout.stages[1])
        self._track([p for dst in dsts for p in post_step(step, None, dst)])

    def _track(self, posted: list) -> None:
        """Keep one step's sends; wait for the oldest while more than max_in_flight steps are on the wire."""
        self.seq += 1
        self.last_post = time.monotonic()
        self.in_flight.append(posted)
        while len(self.in_flight) > self.max_in_flight:  # stage 1 is behind: wait for it
            wait_posted(self.in_flight.popleft(), self.timeout_s, "a step to the next stage")

    def _drain(self) -> None:
        while self.in_flight:
            wait_posted(self.in_flight.popleft(), self.timeout_s, "a step to the next stage")


class SPPLeaderEngine(Engine):
    """The leader of an SPP engine over `layout` (this rank is `layout.leader`, stage 0's first TP rank).

    `config` should come from `spp_engine_config` (the stages size their caches the same way). Requests are added,
    stepped (by its own scheduler or as directed steps) and aborted as on `Engine`; the KV hand-off calls
    (prefill-only requests, reserve/resume, preemption out) are not available on a pipeline yet and raise
    ValueError."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        head: Tensor,
        layout: PipelineLayout,
        *,
        timeout_s: float = SEND_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        want = stage_layers(model.config.num_layers, layout.spp, 0)
        if model.layer_range != want or model.shard.world != layout.tp:
            raise ValueError(f"the leader holds stage 0: layers {want} at TP {layout.tp}")
        super().__init__(replace(config, cuda_graphs=False, fused_cpu_decode=False), model=model)
        self.layout = layout
        self.runner = SPPRunner(
            self.model, self.cache, head, layout, attention_backend=self.attention_backend, timeout_s=timeout_s,
            max_in_flight=2 * layout.spp,
        )  # fmt: skip
        self.keepalive_s = keepalive_s
        self._closed = False

    @property
    def stats(self) -> PipelineStats:
        return self.runner.stats

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        if prefill_only:
            raise ValueError("a pipeline-parallel engine decodes its own requests (no prefill-only hand-off yet)")
        super().add_request(request_id, prompt_token_ids, params)

    def _no_handoff(self, *_: object, **__: object) -> None:
        raise ValueError("KV hand-off is not available on a pipeline-parallel engine yet")

    reserve = resume = add_prefilled = preempt_out = export_kv = decode_held = _no_handoff  # type: ignore[assignment]

    def has_unfinished(self) -> bool:
        due = not self._closed and time.monotonic() - self.runner.last_post >= self.keepalive_s
        return due or super().has_unfinished()

    def step(self) -> list[StepOutput]:
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        chunks = self.scheduler.schedule()
        if not chunks:
            self.runner.keepalive()
            return []
        return self._run(chunks)

    def close(self) -> None:
        """Stop the later stages (best effort); the engine takes no further steps."""
        if self._closed:
            return
        self._closed = True
        try:
            self.runner.stop()
        except RuntimeError as e:
            log.warning("could not stop the pipeline stages: %s", e)
