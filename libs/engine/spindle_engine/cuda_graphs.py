"""Decode-only steps over static input buffers, replayed as one CUDA graph per batch-size bucket.

A decode step launches ~15 kernels per layer; at small batches the GPU waits on the host. `DecodeGraphRunner`
captures the whole forward (embedding .. fp32 logits) once per bucket (1, 2, 4, 8, 16, 24, ... up to
`max_batch`) and replays the smallest bucket that holds the step's batch:

- Inputs live in static buffers: `meta[bucket]` `[4, bucket]` int64 (ids, positions, slots, seq lens) and one
  block table `[max_batch, max_blocks]` shared by all buckets (a bucket uses its first rows). A step copies
  its values in (pinned, non-blocking) and replays; the logits land in a static `[max_batch, vocab]` buffer.
- Padded rows are harmless: token 0 at position 0, seq len 1, writing and reading only `scratch_slot`, a slot
  of a KV block the allocator never hands out (the engine makes the cache one block larger). Their logits
  are computed and never returned.
- The attention launch has fixed parameters: `max_seq_len` = max_model_len and a num_splits chosen per bucket
  for that length, so its grid never depends on the step and nothing reads back to the host.
- Graphs are captured on a bucket's first use (warm-up run, then capture; `capture_s` records the time), or
  all at once by `capture_all` (the engine's `cuda_graphs_at_start`: a burst of new batch sizes then never
  waits 0.1-1.5 s per capture), all in one memory pool: only one graph runs at a time, and their outputs are
  outside the pool.

Mode "emulate" (tests, CPU): the same buffers, padding and slicing, but the "replay" runs the forward eagerly
over the static buffers, so everything but `torch.cuda.graph` itself is testable without a GPU. It is
switched on with SPINDLE_DECODE_GRAPHS_EMULATE=1 (when real capture does not apply).
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import Tensor

from spindle_model import LlamaModel

from .attention import PagedAttentionContext, TritonPagedAttentionContext
from .kv_cache import KVCache

EMULATE_ENV = "SPINDLE_DECODE_GRAPHS_EMULATE"
log = logging.getLogger("spindle.engine.cuda_graphs")


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, then multiples of 8, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def graph_mode(enabled: bool, device: torch.device, attention_backend: str, model: LlamaModel) -> str | None:
    """The mode: "cuda" (capture and replay), "emulate" (static buffers, eager forward) or None (eager).

    Only the Triton context is captured: its decode launch takes a host-side max length and a fixed grid.
    The other contexts run eagerly on CUDA (flash-attn included); emulation covers the "torch" one on CPU."""
    if not enabled or not (model.is_first and model.is_last):
        return None
    if any(layer.tp_group is not None for layer in model.layers):  # collectives are not captured
        return None
    if attention_backend not in ("torch", "triton"):
        return None
    if device.type == "cuda" and attention_backend == "triton":
        return "cuda"
    if os.environ.get(EMULATE_ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
        return "emulate"
    return None


class DecodeGraphRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        *,
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
        attention_backend: str,
        mode: str,
    ) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"mode must be 'cuda' or 'emulate', got {mode!r}")
        if not 0 <= scratch_block < cache.k.shape[1]:
            raise ValueError(f"scratch block {scratch_block} is not a block of the cache")
        self.model = model
        self.cache = cache
        self.mode = mode
        self.attention_backend = attention_backend
        self.device = cache.k.device
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_model_len = max_model_len
        self.block_size = cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * self.block_size
        index_dtype = torch.int32 if attention_backend == "triton" else torch.long
        self.meta = {b: torch.zeros(4, b, dtype=torch.long, device=self.device) for b in self.buckets}
        self.block_table = torch.zeros(self.max_batch, self.max_blocks, dtype=index_dtype, device=self.device)
        self.logits = torch.zeros(self.max_batch, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: object | None = None
        self.capture_s: dict[int, float] = {}
        self.bucket_steps: dict[int, int] = {}  # decode steps run through the static buffers, per bucket

    def bucket(self, n: int) -> int:
        """The smallest bucket holding `n` rows (n <= max_batch)."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch {n} exceeds the largest bucket {self.max_batch}")

    def fits(self, n: int, table_width: int) -> bool:
        return 0 < n <= self.max_batch and table_width <= self.max_blocks

    def _context(self, b: int) -> PagedAttentionContext | TritonPagedAttentionContext:
        meta, table = self.meta[b], self.block_table[:b]
        first = self.model.layer_range[0]
        if self.attention_backend == "triton":
            from spindle_attention.triton.paged_decode import default_num_splits

            splits = default_num_splits(b, self.cache.k.shape[3], self.max_model_len, self.device)
            return TritonPagedAttentionContext(
                self.cache, first, meta[2], b, table, meta[3], [], decode_max_len=self.max_model_len, num_splits=splits
            )
        return PagedAttentionContext(self.cache, first, meta[2], b, table, meta[3], [])

    def forward(self, b: int) -> None:
        """The captured work: bucket `b`'s static inputs -> `logits[:b]`."""
        meta = self.meta[b]
        hidden = self.model(meta[1], self._context(b), input_ids=meta[0])
        self.logits[:b].copy_(self.model.compute_logits(hidden))

    def _pad_all(self, b: int) -> None:
        self.meta[b].copy_(torch.tensor([[0] * b, [0] * b, [self.scratch_slot] * b, [1] * b]))
        self.block_table[:b, 0] = self.scratch_block

    def capture(self, b: int, *, at_start: bool = False) -> None:
        """Warm up (compiles kernels, sets up cuBLAS) and capture bucket `b`, over padding-only inputs."""
        assert self.mode == "cuda" and b not in self.graphs
        t0 = time.perf_counter()
        self._pad_all(b)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": a service's other threads (the KV receiver) keep copying to the GPU during a capture;
        # the default "global" mode fails their calls (cudaErrorStreamCaptureUnsupported)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.forward(b)
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b] = graph
        self.capture_s[b] = time.perf_counter() - t0
        if at_start:
            log.debug("decode graph for batch bucket %d captured in %.3f s", b, self.capture_s[b])
        else:
            log.info("decode graph for batch bucket %d captured in %.3f s (the step that needed it waited)", b,
                     self.capture_s[b])  # fmt: skip

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, largest first (the pool is sized by the largest)."""
        assert self.mode == "cuda"
        t0 = time.perf_counter()
        todo = [b for b in reversed(self.buckets) if b not in self.graphs]
        for b in todo:
            self.capture(b, at_start=True)
        log.info("decode graphs for %d batch buckets (1 .. %d) captured in %.1f s", len(todo), self.max_batch,
                 time.perf_counter() - t0)  # fmt: skip

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int], tables: list[list[int]]
    ) -> Tensor:
        """One decode step of `n = len(ids)` sequences (`fits(n, max table length)`). Returns fp32 logits
        `[n, vocab]`: a view of a static buffer, valid until the next step."""
        n = len(ids)
        b = self.bucket(n)
        if self.mode == "cuda" and b not in self.graphs:
            self.capture(b)
        pad = b - n
        meta = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad, seq_lens + [1] * pad],
            dtype=torch.long,
        )
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in tables]
        rows += [[self.scratch_block] + [0] * (width - 1)] * pad
        table = torch.tensor(rows, dtype=self.block_table.dtype)
        if self.device.type == "cuda":
            meta, table = meta.pin_memory(), table.pin_memory()
        self.meta[b].copy_(meta, non_blocking=True)
        self.block_table[:b, :width].copy_(table, non_blocking=True)
        if self.mode == "cuda":
            self.graphs[b].replay()
        else:
            self.forward(b)
        self.bucket_steps[b] = self.bucket_steps.get(b, 0) + 1
        return self.logits[:n]

    @property
    def steps(self) -> int:
        return sum(self.bucket_steps.values())
