"""Paged decode attention on CPU (kernels.c): reads K/V rows in place through the block table.

Work items are (sequence, KV head, context split); each keeps an online-softmax state for the query heads of
its KV head, so every cached row is read once; the splits' states are merged as in `merge_attn_states`.
Same contract as the torch `paged_decode`: fp32 `lse [Hq, B]`, an empty sequence gives (0, -inf).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .native import kernels

SPLIT_TOKENS = 512  # context per work item once there are enough items to fill the threads
MAX_GROUP = 16  # query heads per KV head the kernel handles


def supported(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    return (
        kernels() is not None
        and q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
    )


def num_splits(batch: int, kv_heads: int, max_len: int, threads: int) -> int:
    """Enough context splits that the items keep every thread busy, none shorter than SPLIT_TOKENS."""
    want = -(-4 * threads // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_len // SPLIT_TOKENS)))


class DecodeBatch:
    """One step's decode batch, prepared once and run for every layer (each layer its own cache).

    block_table `[B, max_blocks]`, seq_lens `[B]` (the caller has checked them against the cache shape)."""

    def __init__(self, block_table: Tensor, seq_lens: Tensor, kv_heads: int) -> None:
        self.lib = kernels()
        assert self.lib is not None
        self.table = block_table.to(torch.int64).contiguous()
        self.lens = seq_lens.to(torch.int64).contiguous()
        self.batch = self.lens.shape[0]
        self.threads = torch.get_num_threads()
        max_len = int(self.lens.max()) if self.batch else 0
        self.splits = num_splits(self.batch, kv_heads, max_len, self.threads)

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """q `[B, Hq, D]`; caches `[blocks, block_size, Hkv, D]` (`supported` by the caller). Returns fp32
        `out [B, Hq, D]`, `lse [Hq, B]`."""
        b, hq, d = q.shape
        num_blocks, block_size, hkv, _ = k_cache.shape
        assert b == self.batch and hq % hkv == 0
        qf = q.to(torch.float32).contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        lse = torch.empty(hq, b, dtype=torch.float32)
        if b == 0:
            return out, lse
        rc = self.lib.spindle_paged_decode(
            qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self.table.data_ptr(), self.lens.data_ptr(),
            out.data_ptr(), lse.data_ptr(), b, hq, hkv, d, block_size, self.table.shape[1], num_blocks, float(scale),
            k_cache.element_size(), self.splits, self.threads,
        )  # fmt: skip
        if rc == -3:
            raise IndexError(f"block_table holds a block id outside the cache's {num_blocks} blocks")
        if rc != 0:
            raise RuntimeError(f"spindle_paged_decode failed ({rc})")
        return out, lse
