"""Paged KV cache: per-layer block pools and the allocator that hands blocks to sequences.

Every layer has a pool `[num_blocks, block_size, kv_heads, head_dim]` for K and one for V; a sequence owns
a list of block ids (its block table) that is valid in every layer's pool.
"""

from __future__ import annotations

import torch
from torch import Tensor


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Free list plus owner map. Invariants: free + used == total, one owner per used block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def blocks_needed(self, num_tokens: int, table: list[int]) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def can_allocate(self, num_tokens: int, table: list[int]) -> bool:
        return self.blocks_needed(num_tokens, table) <= len(self._free)

    def allocate(self, owner: str, num_tokens: int, table: list[int]) -> None:
        """Grow `table` (in place) so it holds `num_tokens` tokens."""
        need = self.blocks_needed(num_tokens, table)
        if need > len(self._free):
            raise OutOfBlocksError(f"{owner} needs {need} blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.pop()
            assert block not in self._owner, f"block {block} handed out twice"
            self._owner[block] = owner
            table.append(block)

    def free(self, owner: str, table: list[int]) -> None:
        """Return every block of `table` and empty it."""
        for block in table:
            assert self._owner.get(block) == owner, f"block {block} freed by {owner}, owned by {self._owner.get(block)}"
            del self._owner[block]
            self._free.append(block)
        table.clear()

    def blocks_by_owner(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for owner in self._owner.values():
            out[owner] = out.get(owner, 0) + 1
        return out

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & self._owner.keys(), "a block is both free and owned"
        assert len(free) + len(self._owner) == self.num_blocks, "blocks leaked"


class KVCache:
    """K and V pools for a contiguous range of layers."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def gather(self, table: list[int], num_tokens: int) -> Tensor:
        """The KV of a sequence's first `num_tokens` tokens -> `[2, layers, tokens, kv_heads, head_dim]`."""
        assert len(table) * self.block_size >= num_tokens
        idx = torch.tensor(table, dtype=torch.long, device=self.k.device)
        out = torch.stack([self.k.index_select(1, idx), self.v.index_select(1, idx)])  # [2, L, nb, bs, H, D]
        return out.flatten(2, 3)[:, :, :num_tokens].contiguous()

    def scatter(self, table: list[int], kv: Tensor) -> None:
        """Write `kv` `[2, layers, tokens, kv_heads, head_dim]` into the blocks of `table`, from token 0."""
        num_tokens = kv.shape[2]
        assert len(table) * self.block_size >= num_tokens
        slots = torch.arange(num_tokens, device=self.k.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.k.device)[slots // self.block_size]
        offsets = slots % self.block_size
        self.k[:, blocks, offsets] = kv[0].to(self.k.device, self.k.dtype)
        self.v[:, blocks, offsets] = kv[1].to(self.v.device, self.v.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
