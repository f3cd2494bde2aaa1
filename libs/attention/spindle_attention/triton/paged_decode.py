"""Split-KV flash-decoding over a block-paged KV cache (Triton counterpart of `spindle_attention.paged`).

Stage 1: program (b, kv_head, split) attends the `GROUP` query heads sharing `kv_head` (one token each) to its
split of sequence b's cached keys, read through the block table, so each cached K/V tile is read once per group.
Stage 2: the splits' partial `(out, lse)` states are merged by the Triton many-way merge.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..paged import DECODE_SPLIT_TOKENS, _check_cache
from ._jit import LOG2E, check_device, dot_precision, head_dim_pad, last_dim_contiguous, lazy_jit, next_pow2
from .merge import merge_attn_states_many

if TYPE_CHECKING:  # bound at the first launch (see _jit.LazyKernel), so importing needs no triton
    import triton.language as tl

# Fewest keys per split worth a program of its own when choosing num_splits on a GPU.
MIN_SPLIT_TOKENS = 256


@lazy_jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    block_table,
    seq_lens,
    Out,
    Lse,
    stride_qb,
    stride_qh,
    stride_kblk,
    stride_kt,
    stride_kh,
    stride_vblk,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lh,
    stride_lb,
    num_splits,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    # Per-sequence split length, a whole number of key tiles, so short sequences use fewer splits.
    per_split = (seq_len + num_splits - 1) // num_splits
    per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kh * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = rows < GROUP
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, HEAD_DIM_PAD]

    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    block_row = block_table + b.to(tl.int64) * stride_bt
    k_base = K + kh * stride_kh
    v_base = V + kh * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blk = tl.load(block_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        k_ptrs = k_base + (blk * stride_kblk + slot * stride_kt)[None, :] + offs_d[:, None]  # [D, BLOCK_N]
        v_ptrs = v_base + (blk * stride_vblk + slot * stride_vt)[:, None] + offs_d[None, :]  # [BLOCK_N, D]
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # start_n < hi, so every tile has a valid key and m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = Out + split * stride_os + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
    tl.store(Lse + split * stride_ls + heads * stride_lh + b.to(tl.int64) * stride_lb, lse, mask=h_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, hkv: int, max_len: int, device: torch.device) -> int:
    """Enough splits to give a GPU about two programs per SM, without splits shorter than MIN_SPLIT_TOKENS."""
    if device.type != "cuda":
        return max(1, math.ceil(max_len / DECODE_SPLIT_TOKENS))
    wanted = math.ceil(2 * _sm_count(device) / max(1, batch * hkv))
    return max(1, min(wanted, math.ceil(max_len / MIN_SPLIT_TOKENS), 64))


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    num_splits: int | None = None,
    softmax_scale: float | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """q `[B, Hq, D]` (one token per sequence, attending to all `seq_lens[b]` cached tokens).

    k_cache/v_cache `[num_blocks, block_size, Hkv, D]`, block_table int `[B, max_blocks]`, seq_lens int `[B]`.
    Returns `out [B, Hq, D]` (q's dtype) and `lse [Hq, B]` fp32; a sequence with `seq_len == 0` gets
    `(0, -inf)`. `num_splits=None` picks a split count for the device; `block_k` is the key tile (power of two
    >= 16). `max_seq_len`, an upper bound of `seq_lens` the caller already knows, saves reading `seq_lens` back
    to the host (a device sync).
    """
    _check_cache(k_cache, v_cache, block_table)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim]; got {tuple(q.shape)}")
    b, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim differs: q {d} vs cache {dk}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"batch mismatch: q {b}, block_table {block_table.shape[0]}, seq_lens {seq_lens.shape}")
    check_device(q, k_cache, v_cache)  # index tensors may live anywhere; they are moved to q's device
    max_len = max_seq_len if max_seq_len is not None else (int(seq_lens.max()) if b else 0)
    if max_len > block_table.shape[1] * page:
        raise ValueError(f"seq_len {max_len} exceeds block_table capacity {block_table.shape[1] * page}")
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, max_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    bn = block_k or (64 if q.device.type == "cuda" else 32)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {bn}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = hq // hkv

    q = last_dim_contiguous(q)
    k_cache, v_cache = last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    table = block_table.to(device=q.device, dtype=torch.int32)
    lens = seq_lens.to(device=q.device, dtype=torch.int32)
    if num_splits == 1:
        # a single split is the answer: write it in q's dtype, no merge
        out = torch.empty(1, b, hq, d, dtype=q.dtype, device=q.device)  # [1, B, Hq, D]
    else:
        out = torch.empty(num_splits, b, hq, d, dtype=torch.float32, device=q.device)  # [splits, B, Hq, D]
    lse = torch.empty(num_splits, hq, b, dtype=torch.float32, device=q.device)  # [splits, Hq, B]
    if b == 0 or hq == 0:
        return out[0], lse[0]
    _paged_decode_kernel[(b, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        table,
        lens,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        num_splits,
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=d,
        HEAD_DIM_PAD=head_dim_pad(d),
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=bn,
        PAGE_SIZE=page,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or 4,
        num_stages=num_stages or 3,
    )
    if num_splits == 1:
        return out[0], lse[0]
    return merge_attn_states_many(out, lse, out_dtype=q.dtype)
