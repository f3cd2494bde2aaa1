"""The engine's attention contexts: each writes a layer's new K/V into the paged cache, then attends.

A step's flat token batch is laid out decode tokens first (one per decoding sequence), then prefill chunks
with no history, then prefill chunks that continue a cached history. Everything a context needs on the
device is built once per step (in its constructor), so the layer loop never syncs with the host.

- `PagedAttentionContext` (contexts "torch" and "reference"): decodes run as one batched `paged_decode` (on
  CPU, the native kernel's batch is prepared once per step and run for every layer); a chunk with history
  attends over the paged cache (`paged_prefill`), and so does a chunk with no history where the native CPU
  prefill kernel runs (it reads the K/V just written in place); elsewhere such a chunk attends to its own
  contiguous K/V. "reference" (`native=False`) keeps the torch path even where the native kernels are built.
- `TritonPagedAttentionContext` (backend "triton", CUDA or TRITON_INTERPRET=1): one `paged_decode` launch for
  the decodes, one varlen `attention_fwd` launch for all chunks with no history (contiguous K/V of this
  step) and one paged launch (the `paged_prefill` kernel) for all chunks with history.
- `FlashPagedAttentionContext` (backend "flash-attn", in flash_attention.py): the same three calls on flash-attn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from spindle_attention import attention_fwd, cpu, paged_decode, paged_prefill

from .kv_cache import KVCache

CONTEXTS = ("torch", "reference", "triton", "flash-attn")  # EngineConfig.resolved_attention_backend's values


def host_to_device(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small index tensor built on the host and copied without blocking (through pinned memory on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk in the flat batch
    length: int
    history: int  # tokens of this sequence already cached before the chunk
    block_table: list[int]  # the sequence's blocks


def write_kv(cache: KVCache, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store this step's K/V of one layer at their slots; returns that layer's pools."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]  # [blocks, block_size, Hkv, D]
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)
    return k_cache, v_cache


class PagedAttentionContext:
    """Contexts "torch" (with `native`: Spindle's native CPU kernels where they are built) and "reference"
    (without): the torch kernels of `spindle_attention`."""

    def __init__(
        self,
        cache: KVCache,
        first_layer: int,
        slot_mapping: Tensor,
        num_decodes: int,
        decode_block_table: Tensor,
        decode_seq_lens: Tensor,
        prefills: list[PrefillChunk],
        *,
        native: bool = True,
    ) -> None:
        self.cache = cache
        self.first_layer = first_layer
        self.slot_mapping = slot_mapping  # [T] flat cache slot of every token in the batch
        self.num_decodes = num_decodes
        self.decode_block_table = decode_block_table  # [num_decodes, max_blocks] int32
        self.decode_seq_lens = decode_seq_lens  # [num_decodes], including the new token
        self.prefills = prefills
        device = cache.k.device
        self.native = native
        native_prefill = native and cpu.prefill.cache_supported(cache.k[0], cache.v[0])
        # per chunk attending over the cache: (block table on the cache's device, total tokens, cu_seqlens)
        self._paged = {
            i: (
                torch.tensor([c.block_table], dtype=torch.int32).to(device),
                torch.tensor([c.history + c.length]),
                torch.tensor([0, c.length]),
            )
            for i, c in enumerate(prefills)
            if c.history or native_prefill
        }
        self._native: cpu.DecodeBatch | None = None
        if native and num_decodes and device.type == "cpu" and cpu.available():  # never builds them elsewhere
            self._native = cpu.DecodeBatch(decode_block_table, decode_seq_lens, cache.k[0].shape[2])

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = write_kv(self.cache, layer - self.first_layer, self.slot_mapping, k, v)
        if self.num_decodes == q.shape[0]:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if self.num_decodes:
            out[: self.num_decodes] = self._decode(q[: self.num_decodes], k_cache, v_cache)
        for i, c in enumerate(self.prefills):
            s, e = c.start, c.start + c.length
            if i not in self._paged:
                out[s:e] = attention_fwd(q[s:e], k[s:e], v[s:e], return_lse=False)[0]
            else:
                table, total, cu = self._paged[i]
                out[s:e] = paged_prefill(q[s:e], k_cache, v_cache, table, total, cu, native=self.native)[0]
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        if self._native is not None and cpu.decode.supported(q, k_cache, v_cache):
            return self._native.run(q, k_cache, v_cache, 1.0 / math.sqrt(q.shape[-1]))[0].to(q.dtype)
        table, lens = self.decode_block_table, self.decode_seq_lens
        return paged_decode(q, k_cache, v_cache, table, lens, return_lse=False, native=self.native)[0]


@dataclass
class _Group:
    """Chunks launched together: their span in the flat batch and the kernel's per-chunk metadata."""

    start: int
    end: int
    max_len: int  # longest chunk (queries)
    cu: Tensor  # [B+1] int32: chunk offsets relative to `start`
    k_lens: Tensor  # cu for contiguous K/V; [B] cached tokens incl. the chunk for paged K/V
    q_offsets: Tensor  # [B] int32: position of each chunk's first query
    k_offsets: Tensor  # [B] int32 zeros
    block_table: Tensor | None  # [B, max_blocks] int32 for paged K/V


def _group(chunks: list[PrefillChunk], paged: bool, device: torch.device) -> _Group | None:
    if not chunks:
        return None
    start = chunks[0].start
    cu = [0]
    for c in chunks:
        assert c.start == start + cu[-1], "a backend group's chunks must be adjacent in the flat batch"
        cu.append(cu[-1] + c.length)
    table = None
    if paged:
        width = max(len(c.block_table) for c in chunks)
        rows = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        table = host_to_device(rows, torch.int32, device)
        k_lens = host_to_device([c.history + c.length for c in chunks], torch.int32, device)
    cu_t = host_to_device(cu, torch.int32, device)
    return _Group(
        start=start,
        end=start + cu[-1],
        max_len=max(c.length for c in chunks),
        cu=cu_t,
        k_lens=k_lens if paged else cu_t,
        q_offsets=host_to_device([c.history for c in chunks], torch.int32, device),
        k_offsets=torch.zeros(len(chunks), dtype=torch.int32, device=device),
        block_table=table,
    )


class ChunkSpan(Protocol):
    """Chunks attended in one call: their span of the flat batch, and their block table when the keys are read
    from the paged cache (None: this step's contiguous K/V)."""

    start: int
    end: int
    block_table: Tensor | None


class ThreeCallContext:
    """A GPU context's layer: decodes in one call, chunks without history in one over this step's contiguous K/V,
    chunks continuing a cached history in one over the paged cache. Subclasses set `cache`, `first_layer`,
    `slot_mapping`, `num_decodes` and the two groups (`fresh`, `continued`: a span `start:end` of the flat batch
    and whatever their kernel takes, `block_table` None for contiguous K/V), and run the calls."""

    cache: KVCache
    first_layer: int
    slot_mapping: Tensor  # [T] flat cache slot of every token in the batch
    num_decodes: int
    fresh: ChunkSpan | None
    continued: ChunkSpan | None

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` (rotated; written into the cache here) -> out `[T, Hq, D]`."""
        k_cache, v_cache = write_kv(self.cache, layer - self.first_layer, self.slot_mapping, k, v)
        nd = self.num_decodes
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache)
        scale = 1.0 / math.sqrt(q.shape[-1])
        for g, keys, values in ((self.fresh, k, v), (self.continued, k_cache, v_cache)):
            if g is not None:
                s, e = g.start, g.end
                if g.block_table is None:
                    keys, values = keys[s:e], values[s:e]
                self._chunks(g, q[s:e], keys, values, out[s:e], scale)
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        raise NotImplementedError

    def _chunks(self, g: ChunkSpan, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, scale: float) -> None:
        """Attend the chunks of `g` (q `[tokens, Hq, D]`; keys/values this step's for them, or the paged cache
        layer) into `out`."""
        raise NotImplementedError


class TritonPagedAttentionContext(ThreeCallContext):
    """Backend "triton": `spindle_attention.triton` kernels, three launches per layer at most."""

    def __init__(
        self,
        cache: KVCache,
        first_layer: int,
        slot_mapping: Tensor,
        num_decodes: int,
        decode_block_table: Tensor,
        decode_seq_lens: Tensor,
        prefills: list[PrefillChunk],
        *,
        decode_max_len: int,
        num_splits: int | None = None,
    ) -> None:
        from spindle_attention.triton._jit import check_device

        check_device(cache.k)  # a clear error when the kernels cannot run here (no triton, CPU without interpreter)
        device = cache.k.device
        self.cache = cache
        self.first_layer = first_layer
        self.slot_mapping = slot_mapping
        self.num_decodes = num_decodes
        self.decode_block_table = decode_block_table  # [num_decodes, max_blocks] int32, on the device
        self.decode_seq_lens = decode_seq_lens  # [num_decodes] int32, on the device
        self.decode_max_len = decode_max_len  # host-side bound of decode_seq_lens: no read-back
        self.num_splits = num_splits  # None: the kernel picks by batch and length
        self.fresh = _group([c for c in prefills if c.history == 0], False, device)
        self.continued = _group([c for c in prefills if c.history > 0], True, device)

    def _chunks(self, g: _Group, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, scale: float) -> None:  # type: ignore[override]
        from spindle_attention.triton.attention_fwd import launch_fwd

        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # [Hq, tokens], unused
        launch_fwd(
            q,
            keys,
            values,
            out,
            lse,
            g.cu,
            g.k_lens,
            g.q_offsets,
            g.k_offsets,
            g.max_len,
            causal=True,
            q_stride=1,
            k_stride=1,
            scale=scale,
            block_table=g.block_table,
            block_m=None,
            block_n=None,
            num_warps=None,
            num_stages=None,
        )

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        from spindle_attention.triton import paged_decode as triton_paged_decode

        return triton_paged_decode(
            q,
            k_cache,
            v_cache,
            self.decode_block_table,
            self.decode_seq_lens,
            num_splits=self.num_splits,
            max_seq_len=self.decode_max_len,
        )[0]
