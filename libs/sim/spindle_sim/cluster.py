"""Simulated instances with block-counted KV: prefill instances that run chunks in SP groups, continuous-batching
decode instances, and colocated (elastic) instances that mix prefill chunks into their decode batches.

They only keep state; the executor (executor.py) decides when things happen and tells the core.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from spindle_policy.actions import PrefillChunk, RunPrefill
from spindle_policy.core import SchedulerConfig
from spindle_protocol.messages import InstanceInfo
from spindle_protocol.registry import HEARTBEAT_S

from .metrics import RequestRecord

LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head dim 128, bf16


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 2
    num_decode: int = 2
    num_colocated: int = 0  # elastic instances that prefill and decode (Sarathi / vLLM style)
    decode_tp: int = 1  # tensor-parallel degree of each decode instance (picks the decode model's coefficients)
    prefill_tp: int = 1  # GPUs of each prefill instance (node packing; the prefill model is fitted at this TP)
    colocated_tp: int = 1  # GPUs of each colocated instance (node packing and the decode model's coefficients)
    # sequence-pipeline stages of each colocated instance (Medha's SPP): it takes colocated_tp x colocated_spp GPUs,
    # and its iterations pipeline over the stages (iteration_side.py)
    colocated_spp: int = 1
    # instances are packed onto nodes in rank order (prefill, then decode, then colocated), an instance of TP t
    # taking t GPUs of one node (pack_nodes)
    gpus_per_node: int = 8
    block_size: int = 16
    prefill_kv_blocks: int = 32768  # per prefill instance (512K tokens at block size 16)
    decode_kv_blocks: int = 32768  # per decode or colocated instance
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN  # sizes the prefill -> decode transfer
    # a query token's q and partial output over every layer (KV-parallel steps send them); 0: 4x the KV's (GQA 4)
    query_bytes_per_token: int = 0
    decode_step_s: float = 0.02  # decode step time when the latency model has no decode part
    heartbeat_s: float = HEARTBEAT_S  # virtual seconds between heartbeats of every instance
    tick_s: float = 0.25  # virtual seconds between core.tick calls
    # the model's context, which every instance reports (0: the smallest instance KV capacity in tokens). Above
    # one instance's capacity, only plans that split the KV (SP prefill groups, kvp_tokens) serve the longest.
    max_model_len: int = 0
    with_kvstore: bool = True  # register a kvstore instance (strategies name it as the park for KV)
    # the kvstore's host tier for KV that iterations offload (Seesaw's CPU KV buffer), in blocks; 0: none
    host_kv_blocks: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError("instance counts must be >= 0")
        if (self.num_prefill < 1 or self.num_decode < 1) and self.num_colocated < 1:
            raise ValueError(
                f"need >= 1 prefill and >= 1 decode instance, or >= 1 colocated instance; got "
                f"{self.num_prefill} prefill, {self.num_decode} decode, {self.num_colocated} colocated"
            )
        sizes = {k: getattr(self, k) for k in ("prefill_tp", "decode_tp", "colocated_tp", "colocated_spp",
                                                 "gpus_per_node")}  # fmt: skip
        if min(sizes.values()) < 1:
            raise ValueError(f"TP sizes and gpus_per_node must be >= 1, got {sizes}")
        if self.host_kv_blocks < 0:
            raise ValueError(f"host_kv_blocks must be >= 0, got {self.host_kv_blocks}")
        if self.block_size < 1 or self.prefill_kv_blocks < 1 or self.decode_kv_blocks < 1:
            raise ValueError("block_size and KV block counts must be >= 1")
        if self.kv_bytes_per_token < 0 or self.query_bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token and query_bytes_per_token must be >= 0")
        if not self.decode_step_s > 0:
            raise ValueError(f"decode_step_s must be > 0, got {self.decode_step_s}")
        if not (self.heartbeat_s > 0 and self.tick_s > 0):
            raise ValueError("heartbeat_s and tick_s must be > 0")
        if self.heartbeat_s >= self.scheduler.dead_after_s:
            raise ValueError("heartbeat_s must be below the scheduler's dead_after_s or every instance dies")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")

    def instance_widths(self) -> list[int]:
        """GPUs of each instance in rank order: prefill, then decode, then colocated."""
        return (
            [self.prefill_tp] * self.num_prefill
            + [self.decode_tp] * self.num_decode
            + [self.colocated_tp * self.colocated_spp] * self.num_colocated
        )

    def capacity_tokens(self) -> int:
        """The longest sequence one instance can hold (a prompt on an SP group is split, but decode is not)."""
        if self.num_prefill and self.num_decode:
            return min(self.prefill_kv_blocks, self.decode_kv_blocks) * self.block_size
        return self.decode_kv_blocks * self.block_size

    def context_len(self) -> int:
        return self.max_model_len or self.capacity_tokens()

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def next_start(gpus: int, width: int, gpus_per_node: int) -> int:
    """Where an instance of `width` GPUs starts when the GPUs before `gpus` are taken: here, or at the next node
    when this node has fewer than `width` left (the rest of it idles)."""
    used = gpus % gpus_per_node
    return gpus + gpus_per_node - used if used and used + width > gpus_per_node else gpus


def pack_nodes(widths: list[int], gpus_per_node: int) -> list[int]:
    """The node of each instance, packed in order (next_start); one wider than a node takes whole nodes."""
    if gpus_per_node < 1 or any(w < 1 for w in widths):
        raise ValueError(f"instance widths and gpus_per_node must be >= 1, got {widths}, {gpus_per_node}")
    nodes, gpus = [], 0
    for width in widths:
        start = next_start(gpus, width, gpus_per_node)
        nodes.append(start // gpus_per_node)
        gpus = start + width
    return nodes


@dataclass(eq=False)
class ChunkJob:
    """One chunk of a request's prefill plan, queued on every instance of its group."""

    rec: RequestRecord
    plan: RunPrefill
    index: int  # position in plan.chunks

    @property
    def chunk(self) -> PrefillChunk:
        return self.plan.chunks[self.index]

    @property
    def is_last(self) -> bool:
        return self.index == len(self.plan.chunks) - 1


@dataclass(eq=False)
class SimInstance:
    id: str
    role: str
    rank: int
    total_blocks: int
    block_size: int
    max_model_len: int
    used_blocks: int = 0
    peak_blocks: int = 0
    held: dict[str, int] = field(default_factory=dict)  # request id -> blocks
    busy_spans: list[tuple[float, float]] = field(default_factory=list)  # prefill chunk runs, for invariant checks
    node: str = ""
    kv_bytes_per_token: int = 0

    def alloc(self, rid: str, blocks: int) -> None:
        assert self.used_blocks + blocks <= self.total_blocks, f"KV capacity of {self.id} exceeded"
        self.held[rid] = self.held.get(rid, 0) + blocks
        self.used_blocks += blocks
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)

    def free(self, rid: str) -> None:
        self.used_blocks -= self.held.pop(rid, 0)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def info(self, now: float) -> InstanceInfo:
        return InstanceInfo(
            instance_id=self.id,
            role=self.role,
            rank=self.rank,
            pid=0,
            started_at=0.0,
            updated_at=now,
            kv_blocks_total=self.total_blocks,
            kv_blocks_used=self.used_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            node=self.node,
            tp_size=getattr(self, "tp", 1),
            spp_size=getattr(self, "spp", 1),
            kvp_group=getattr(self, "kvp_group", ""),
            kv_bytes_per_token=self.kv_bytes_per_token,
            parallel=getattr(self, "parallel", ""),
            **self._load(),
        )

    def _load(self) -> dict[str, int]:
        return {}


@dataclass(eq=False)
class SimPrefill(SimInstance):
    """Runs one chunk at a time, FCFS; a chunk on an SP group starts when it heads every member's queue and all
    members are idle. Holds its share of a request's prompt KV from the chunk's start until the transfer ends."""

    tp: int = 1
    queue: deque[ChunkJob] = field(default_factory=deque)
    running: ChunkJob | None = None
    queued_tokens: int = 0  # this instance's share of chunk tokens accepted and not yet computed

    def _load(self) -> dict[str, int]:
        return {
            "num_running": int(self.running is not None),
            "num_waiting": len(self.queue),
            "queued_tokens": self.queued_tokens,
        }


@dataclass(eq=False)
class SimDecode(SimInstance):
    """Continuous batching. A request joins when blocks for prompt + all its output tokens fit (FIFO); until
    then its KV is parked (in the kvstore). One step yields one token per running request. A `Preempt` swaps a
    running request's KV out to the kvstore (after the step in flight) and queues it again at the back."""

    tp: int = 1
    # the simulated decode instances form one KV-parallel group (a split request's holders step independently
    # here, the slowest one setting the master's step; the services' group steps in lockstep)
    kvp_group: str = "decode"
    waiting: deque[RequestRecord] = field(default_factory=deque)
    running: list[RequestRecord] = field(default_factory=list)
    kv_tokens: int = 0  # context tokens of the running batch
    stepping: bool = False
    preempt_after_step: set[str] = field(default_factory=set)  # request ids to swap out when the step ends

    def _load(self) -> dict[str, int]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting)}


@dataclass(eq=False)
class SimColocated(SimDecode):
    """An elastic instance. Under a plan-at-arrival strategy each step runs the running decodes and pieces of
    prompts under a token budget (colocated_side.py); a request takes blocks for its whole sequence when it is
    admitted. Per-iteration strategies send it `RunBatch` iterations instead (iteration_side.py)."""

    kvp_group: str = ""
    spp: int = 1  # sequence-pipeline stages (SimConfig.colocated_spp; a re-sharding group's: its configuration's PP)
    parallel: str = ""  # a re-sharding group's configuration now (tier_side.py); "" = it does not re-shard
    prompts: deque[RequestRecord] = field(default_factory=deque)  # placed here, not admitted yet (FCFS)
    prefilling: list[RequestRecord] = field(default_factory=list)  # admitted, prompt not done, in admission order
    computed: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens computed (prefilling)
    queued_tokens: int = 0  # prompt tokens placed here and not computed yet
    step_chunks: list[tuple[RequestRecord, int, int]] = field(default_factory=list)  # (request, start, tokens)
    step_batch: list[RequestRecord] = field(default_factory=list)  # the decodes in the step now running

    def _load(self) -> dict[str, int]:
        return {
            "num_running": len(self.running) + len(self.prefilling),
            "num_waiting": len(self.prompts),
            "queued_tokens": self.queued_tokens,
        }
