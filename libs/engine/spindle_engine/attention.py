"""The engine's attention context: writes each layer's new K/V into the paged cache, then attends.

A step's flat token batch is laid out decode tokens first (one per decoding sequence), then prefill
chunks. Decodes run as one batched `paged_decode` (on CPU, the native kernel's batch is prepared once per
step and run for every layer); a chunk with no history attends to itself (one
`scaled_dot_product_attention`), a chunk with history attends over the paged cache (`paged_prefill`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from spindle_attention import attention_fwd, cpu, paged_decode, paged_prefill

from .kv_cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk in the flat batch
    length: int
    history: int  # tokens of this sequence already cached before the chunk
    block_table: Tensor  # [1, blocks] int32


class PagedAttentionContext:
    def __init__(
        self,
        cache: KVCache,
        first_layer: int,
        slot_mapping: Tensor,
        num_decodes: int,
        decode_block_table: Tensor,
        decode_seq_lens: Tensor,
        prefills: list[PrefillChunk],
    ) -> None:
        self.cache = cache
        self.first_layer = first_layer
        self.slot_mapping = slot_mapping  # [T] flat cache slot of every token in the batch
        self.num_decodes = num_decodes
        self.decode_block_table = decode_block_table  # [num_decodes, max_blocks] int32
        self.decode_seq_lens = decode_seq_lens  # [num_decodes], including the new token
        self.prefills = prefills
        self._native: cpu.DecodeBatch | None = None
        if num_decodes and cpu.available() and cache.k[0].device.type == "cpu":
            self._native = cpu.DecodeBatch(decode_block_table, decode_seq_lens, cache.k[0].shape[2])

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache = self.cache.k[layer - self.first_layer]  # [blocks, block_size, Hkv, D]
        v_cache = self.cache.v[layer - self.first_layer]
        hkv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, hkv, d).index_copy_(0, self.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, self.slot_mapping, v)
        if self.num_decodes == q.shape[0]:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if self.num_decodes:
            out[: self.num_decodes] = self._decode(q[: self.num_decodes], k_cache, v_cache)
        for c in self.prefills:
            s, e = c.start, c.start + c.length
            if c.history == 0:
                out[s:e] = attention_fwd(q[s:e], k[s:e], v[s:e], return_lse=False)[0]
            else:
                total = torch.tensor([c.history + c.length])
                cu = torch.tensor([0, c.length])
                out[s:e] = paged_prefill(q[s:e], k_cache, v_cache, c.block_table, total, cu)[0]
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        if self._native is not None and cpu.decode.supported(q, k_cache, v_cache):
            return self._native.run(q, k_cache, v_cache, 1.0 / math.sqrt(q.shape[-1]))[0].to(q.dtype)
        return paged_decode(q, k_cache, v_cache, self.decode_block_table, self.decode_seq_lens, return_lse=False)[0]
