"""Causal prefill attention of one chunk on CPU (prefill.c), reading K/V through the block table in place.

The chunk's queries sit at positions `history .. history + n - 1` and see every cached key up to their own
position. GQA is folded (each K/V tile is loaded once for all query heads of its KV head), K is packed
transposed in 64-key tiles and V row-major once per call, and the scores of 6 query rows x 64 keys are
computed in registers before an online-softmax update. Same contract as the torch `paged_prefill` for one
sequence: out `[n, Hq, D]`, fp32 natural-log `lse [Hq, n]`. fp32 only; the head dim a multiple of 64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .native import kernels


def cache_supported(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether `attention` can read these caches (fp32, contiguous, on CPU, head dim a multiple of 64 up to 256)."""
    d = k_cache.shape[-1]
    return (
        kernels() is not None
        and k_cache.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and d % 64 == 0
        and d <= 256
    )


def supported(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether `attention` can run these operands (else use the torch path)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and cache_supported(k_cache, v_cache)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, history: int,
              scale: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """q `[n, Hq, D]`; caches `[blocks, block_size, Hkv, D]` holding the sequence's first `history + n` tokens
    through `block_table` `[max_blocks]` (a contiguous `[tokens, Hkv, D]` is `k.unsqueeze(0)` with table `[0]`).
    Returns out `[n, Hq, D]`, lse `[Hq, n]`."""
    lib = kernels()
    assert lib is not None
    n, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    table = block_table.to(torch.int64).contiguous()
    if table.numel() * block_size < history + n:
        raise ValueError(f"block table covers {table.numel() * block_size} tokens, the chunk needs {history + n}")
    qf = q.contiguous()
    out = torch.empty(n, hq, d, dtype=torch.float32)
    lse = torch.empty(hq, n, dtype=torch.float32)
    if n == 0:
        return out, lse
    rc = lib.spindle_prefill_attention(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), block_size, num_blocks,
        out.data_ptr(), lse.data_ptr(), n, history, hq, hkv, d, float(scale), torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise IndexError(f"block_table holds a block id outside the cache's {num_blocks} blocks")
    if rc != 0:
        raise RuntimeError(f"spindle_prefill_attention failed ({rc})")
    return out, lse
