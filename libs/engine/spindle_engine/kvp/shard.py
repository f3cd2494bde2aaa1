"""One KVP member's paged store: the token ranges it holds of each request, in blocks it owns.

A range `[start, end)` of a request lives from local slot 0 on (local slot = position - start), in blocks
from the member's `BlockAllocator`, owned by the request id. The tail member grows its range one token per
step; a holder computes partial attention `(out, lse)` of a batch of queries over its ranges. A scale-down
(plan.py) hands a leaving member's range to an adjacent holder: the leaver `take`s its KV out (and frees its
blocks), the receiver `make_room`s for it before anything moves, then `merge`s it in at its range's end or
front (a front merge lays the receiver's own KV out again after the received tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from spindle_attention import paged_decode

from ..kv_cache import BlockAllocator, KVCache


@dataclass
class _Range:
    start: int
    num_tokens: int = 0
    table: list[int] = field(default_factory=list)


class KVShard:
    def __init__(self, cache: KVCache, allocator: BlockAllocator) -> None:
        if cache.block_size != allocator.block_size:
            raise ValueError(f"cache block size {cache.block_size} != allocator block size {allocator.block_size}")
        self.cache = cache
        self.allocator = allocator
        self.block_size = cache.block_size
        self._ranges: dict[str, _Range] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ranges

    def num_tokens(self, request_id: str) -> int:
        return self._ranges[request_id].num_tokens

    def start(self, request_id: str) -> int:
        return self._ranges[request_id].start

    def add_range(self, request_id: str, start: int, kv: Tensor | None = None) -> None:
        """Hold `request_id`'s tokens from `start` on: `kv` `[2, layers, n, Hkv, D]` for `[start, start+n)`,
        or none yet (a scale-up's new tail). Raises OutOfBlocksError, holding nothing, when they do not fit."""
        if request_id in self._ranges:
            raise ValueError(f"request {request_id!r} already has a range here")
        r = _Range(start)
        if kv is not None and kv.shape[2]:
            self.allocator.allocate(request_id, kv.shape[2], r.table)
            self.cache.scatter(r.table, kv)
            r.num_tokens = kv.shape[2]
        self._ranges[request_id] = r

    def blocks_to_grow(self, request_id: str, n: int = 1) -> int:
        r = self._ranges[request_id]
        return self.allocator.blocks_needed(r.num_tokens + n, r.table)

    def grow(self, request_id: str, n: int = 1) -> Tensor:
        """Room for `n` more tokens at the end of the range; returns their flat cache slots `[n]` (written
        layer by layer with `write`). Raises OutOfBlocksError when the blocks are not free."""
        r = self._ranges[request_id]
        self.allocator.allocate(request_id, r.num_tokens + n, r.table)
        device = self.cache.k.device  # index ops on a GPU cache take indices on the GPU
        local = torch.arange(r.num_tokens, r.num_tokens + n, device=device)
        r.num_tokens += n
        blocks = torch.tensor(r.table, dtype=torch.long, device=device)[local // self.block_size]
        return blocks * self.block_size + local % self.block_size

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v `[n, Hkv, D]` into flat `slots` of local layer `layer`."""
        hkv, d = k.shape[1], k.shape[2]
        self.cache.k[layer].view(-1, hkv, d).index_copy_(0, slots, k)
        self.cache.v[layer].view(-1, hkv, d).index_copy_(0, slots, v)

    def attend(self, layer: int, request_ids: list[str], q: Tensor) -> tuple[Tensor, Tensor]:
        """Partial attention of q `[B, Hq, D]` (row i of `request_ids[i]`) over this member's ranges.

        Returns out `[B, Hq, D]` and lse `[Hq, B]` fp32, ready for `merge_attn_states_many`."""
        ranges = [self._ranges[rid] for rid in request_ids]
        width = max((len(r.table) for r in ranges), default=1)
        table = torch.zeros(len(ranges), max(width, 1), dtype=torch.int64)
        for i, r in enumerate(ranges):
            table[i, : len(r.table)] = torch.tensor(r.table, dtype=torch.int64)
        lens = torch.tensor([r.num_tokens for r in ranges], dtype=torch.int64)
        table, lens = table.to(q.device), lens.to(q.device)  # the kernel's metadata beside q and the cache
        out, lse = paged_decode(q.contiguous(), self.cache.k[layer], self.cache.v[layer], table, lens, return_lse=True)
        assert lse is not None
        return out, lse

    def _write_tokens(self, r: _Range, first: int, kv: Tensor) -> None:
        """`kv` `[2, layers, n, Hkv, D]` into local slots `[first, first + n)` of `r` (blocks already held)."""
        local = torch.arange(first, first + kv.shape[2], device=self.cache.k.device)
        blocks = torch.tensor(r.table, dtype=torch.long, device=self.cache.k.device)[local // self.block_size]
        offsets = local % self.block_size
        self.cache.k[:, blocks, offsets] = kv[0].to(self.cache.k.device, self.cache.k.dtype)
        self.cache.v[:, blocks, offsets] = kv[1].to(self.cache.v.device, self.cache.v.dtype)

    def take(self, request_id: str) -> Tensor:
        """Hand this member's range away: its KV `[2, layers, n, Hkv, D]`, its blocks freed."""
        kv = self.read(request_id)
        self.free(request_id)
        return kv

    def make_room(self, request_id: str, n: int) -> None:
        """Blocks for `n` more tokens of `request_id` (a merge to come). Raises OutOfBlocksError, changing nothing."""
        r = self._ranges[request_id]
        self.allocator.allocate(request_id, r.num_tokens + n, r.table)

    def merge(self, request_id: str, kv: Tensor, *, front: bool) -> None:
        """Add a neighbouring range's KV `[2, layers, n, Hkv, D]` (room made first) after this member's range, or
        before it when `front` (its start moves down by n and its own tokens move up by n local slots)."""
        r = self._ranges[request_id]
        n = kv.shape[2]
        assert self.allocator.blocks_needed(r.num_tokens + n, r.table) == 0, "make_room before merging"
        if front:
            own = self.cache.gather(r.table, r.num_tokens)
            self._write_tokens(r, 0, torch.cat([kv.to(own.device, own.dtype), own], dim=2))
            r.start -= n
        else:
            self._write_tokens(r, r.num_tokens, kv)
        r.num_tokens += n

    def read(self, request_id: str) -> Tensor:
        """This member's KV of `request_id` -> `[2, layers, n, Hkv, D]` (tests and hand-offs)."""
        r = self._ranges[request_id]
        return self.cache.gather(r.table, r.num_tokens)

    def free(self, request_id: str) -> bool:
        r = self._ranges.pop(request_id, None)
        if r is None:
            return False
        self.allocator.free(request_id, r.table)
        return True

    def free_all(self) -> None:
        for rid in list(self._ranges):
            self.free(rid)

    @property
    def request_ids(self) -> list[str]:
        return list(self._ranges)
