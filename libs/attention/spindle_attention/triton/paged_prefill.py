"""Chunked prefill over a block-paged KV cache (Triton counterpart of `spindle_attention.paged.paged_prefill`).

Runs the flash-attention forward kernel with its keys read through the block table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..paged import _check_cache
from ..reference import _split
from ._jit import check_device, last_dim_contiguous
from .attention_fwd import launch_fwd


def paged_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    softmax_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked prefill over paged history. q `[Tq, Hq, D]` packs B chunks (`cu_seqlens_q`, int `[B+1]`).

    Sequence b has `seq_lens[b]` tokens cached, its chunk being the last `n_b` of them (the chunk's KV must
    already be in the cache), so its queries sit at positions `seq_lens[b] - n_b ...` and attend causally to
    everything cached before them. k_cache/v_cache `[num_blocks, block_size, Hkv, D]`, block_table int
    `[B, max_blocks]`. Returns `out [Tq, Hq, D]` (q's dtype) and `lse [Hq, Tq]` fp32.
    `block_q`/`block_k`/`num_warps`/`num_stages` are as in `attention_fwd`.
    """
    _check_cache(k_cache, v_cache, block_table)
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim]; got {tuple(q.shape)}")
    tq, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim differs: q {d} vs cache {dk}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    _, lens = _split(cu_seqlens_q, tq)
    totals = [int(x) for x in seq_lens.tolist()]
    if len(totals) != len(lens) or block_table.shape[0] != len(lens):
        raise ValueError(f"{len(lens)} chunks but {len(totals)} seq_lens / {block_table.shape[0]} block rows")
    for i, (n, total) in enumerate(zip(lens, totals, strict=True)):
        if n > total:
            raise ValueError(f"chunk of {n} tokens longer than the {total} cached for sequence {i}")
    if max(totals, default=0) > block_table.shape[1] * page:
        raise ValueError(f"seq_len {max(totals)} exceeds block_table capacity {block_table.shape[1] * page}")
    check_device(q, k_cache, v_cache)  # index tensors may live anywhere; they are moved to q's device
    device = q.device
    k_lens = seq_lens.to(device=device, dtype=torch.int32)
    cu_q = cu_seqlens_q.to(device=device, dtype=torch.int32)
    q_offsets = k_lens - (cu_q[1:] - cu_q[:-1])  # each chunk ends at its sequence's last cached token
    k_offsets = torch.zeros_like(k_lens)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    q = last_dim_contiguous(q)
    k_cache, v_cache = last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=device)  # [Tq, Hq, D]
    lse = torch.empty(hq, tq, dtype=torch.float32, device=device)  # [Hq, Tq]
    launch_fwd(
        q,
        k_cache,
        v_cache,
        out,
        lse,
        cu_q,
        k_lens,
        q_offsets,
        k_offsets,
        max(lens, default=0),
        causal=True,
        q_stride=1,
        k_stride=1,
        scale=scale,
        block_table=block_table.to(device=device, dtype=torch.int32),
        block_m=block_q,
        block_n=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse
