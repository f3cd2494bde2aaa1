"""The KV one rank holds for one request during sequence-parallel prefill, in the engine's paged cache.

Entries are kept in arrival order (entry i sits in slot `table[i // bs] * bs + i % bs`); `positions[i]` is
its absolute token position. Blocks come from the engine's allocator under the request's id, so the
instance's block accounting (and "every block freed") covers SP prefill like any other request.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_cache import BlockAllocator, KVCache


class HeldKV:
    def __init__(self, cache: KVCache, allocator: BlockAllocator, owner: str) -> None:
        self.cache = cache
        self.allocator = allocator
        self.owner = owner
        self.table: list[int] = []
        self.positions = torch.empty(0, dtype=torch.int64)  # [n]

    def __len__(self) -> int:
        return self.positions.numel()

    def slots(self, lo: int = 0, hi: int | None = None) -> Tensor:
        hi = len(self) if hi is None else hi
        bs = self.cache.block_size
        i = torch.arange(lo, hi)
        slots = torch.tensor(self.table, dtype=torch.int64)[i // bs] * bs + i % bs if hi > lo else i
        return slots.to(self.cache.k.device)  # index ops on a GPU cache take indices on the GPU

    def grow(self, positions: Tensor) -> Tensor:
        """Append entries for `positions` (allocating blocks); returns their slots. Values are written later."""
        lo = len(self)
        self.allocator.allocate(self.owner, lo + positions.numel(), self.table)
        self.positions = torch.cat([self.positions, positions.to(device="cpu", dtype=torch.int64)])  # host bookkeeping
        return self.slots(lo)

    def read(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[Tensor, Tensor]:
        """Copies of entries `[lo, hi)` of `layer`: k, v `[n, Hkv, D]`."""
        s = self.slots(lo, hi)
        k, v = self.cache.k[layer], self.cache.v[layer]  # [blocks, bs, Hkv, D]
        return k.flatten(0, 1).index_select(0, s), v.flatten(0, 1).index_select(0, s)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        self.cache.k[layer].flatten(0, 1).index_copy_(0, slots, k)
        self.cache.v[layer].flatten(0, 1).index_copy_(0, slots, v)

    def truncate(self, n: int) -> None:
        """Keep entries `[0, n)` and give back the blocks past them."""
        assert 0 <= n <= len(self)
        keep = -(-n // self.cache.block_size)
        tail = self.table[keep:]
        del self.table[keep:]
        self.allocator.free(self.owner, tail)
        self.positions = self.positions[:n]

    def export(self) -> Tensor:
        """All entries, every layer: `[2, layers, n, Hkv, D]` (a copy)."""
        s = self.slots()
        k = self.cache.k.flatten(1, 2).index_select(1, s)
        v = self.cache.v.flatten(1, 2).index_select(1, s)
        return torch.stack([k, v])

    def free(self) -> None:
        self.allocator.free(self.owner, self.table)
        self.positions = self.positions[:0]
