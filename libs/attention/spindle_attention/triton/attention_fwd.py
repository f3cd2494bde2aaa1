"""Flash-attention forward in Triton: the GPU counterpart of `spindle_attention.reference.attention_fwd`.

One program computes a tile of `BLOCK_M` query rows of one sequence for one KV head: `BLOCK_M // G` query tokens
times the G query heads sharing that KV head (GQA packed into the rows, so each K/V tile is loaded once per
group). It streams the sequence's keys in `BLOCK_N` tiles with an online softmax (base-2 exponentials, fp32
accumulators).
Causality is positional (query i sees key j iff `k_pos[j] <= q_pos[i]`, positions `offset + index * stride`),
and since positions rise with the index, a query tile needs only the keys up to the one its last query can see:
key tiles entirely in the future are never loaded, tiles every query of the tile can see fully run without a
mask, and only the tiles straddling the diagonal are masked.

The same kernel reads keys through a block table (`PAGED`) for `paged_prefill`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..reference import _check_qkv, _split
from ._jit import LOG2E, check_device, dot_precision, head_dim_pad, last_dim_contiguous, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound at the first launch (see _jit.LazyKernel), so importing needs no triton
    import triton.language as tl


@lazy_jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_base,
    v_base,
    k_start,
    k_len,
    k_off,
    k_stride,
    block_row,
    stride_kt,
    stride_kblk,
    stride_vt,
    stride_vblk,
    lo,
    hi,
    qk_scale,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax accumulation over key tiles [lo, hi); `MASKED` tiles apply the key-count and causal masks."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if PAGED:
            # key index n lives in block block_row[n // PAGE_SIZE] at slot n % PAGE_SIZE
            if MASKED:
                blk = tl.load(block_row + offs_n // PAGE_SIZE, mask=offs_n < k_len, other=0).to(tl.int64)
            else:
                blk = tl.load(block_row + offs_n // PAGE_SIZE).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
            k_rows = blk * stride_kblk + slot * stride_kt
            v_rows = blk * stride_vblk + slot * stride_vt
        else:
            k_rows = (k_start + offs_n).to(tl.int64) * stride_kt
            v_rows = (k_start + offs_n).to(tl.int64) * stride_vt
        k_ptrs = k_base + k_rows[None, :] + offs_d[:, None]  # [HEAD_DIM_PAD, BLOCK_N]
        v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        if MASKED:
            n_mask = offs_n < k_len
            k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                k_pos = k_off + offs_n * k_stride
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row that has seen no key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@lazy_jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_seqlens_q,
    k_lens,
    q_offsets,
    k_offsets,
    block_table,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_kblk,
    stride_vt,
    stride_vh,
    stride_vblk,
    stride_ot,
    stride_oh,
    stride_lh,
    stride_bt,
    q_stride,
    k_stride,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Heaviest causal tiles (the last query rows see the most keys) start first, so the light ones fill the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kh = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    tok_lo = pid_m * TOKENS_M
    if tok_lo >= q_len:
        return
    # Contiguous keys: k_lens is cu_seqlens_k. Paged keys: k_lens is seq_lens and indices are per sequence.
    if PAGED:
        k_start = 0
        k_len = tl.load(k_lens + b)
    else:
        k_start = tl.load(k_lens + b)
        k_len = tl.load(k_lens + b + 1) - k_start
    q_off = tl.load(q_offsets + b)
    k_off = tl.load(k_offsets + b)

    # Row r of the tile is query token tok_lo + r // GROUP of query head kh * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    offs_m = tok_lo + rows // GROUP
    heads = kh * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = (rows < TOKENS_M * GROUP) & (offs_m < q_len)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = q_off + offs_m * q_stride

    if CAUSAL:
        # Number of keys visible to the tile's first / last query (positions rise with the index, so that is a
        # prefix): (max(pos - k_off, -1) + k_stride) // k_stride counts keys with k_pos <= pos, no negative division.
        q_lo = q_off + tok_lo * q_stride
        q_hi = q_off + (tl.minimum(tok_lo + TOKENS_M, q_len) - 1) * q_stride
        n_first = tl.minimum((tl.maximum(q_lo - k_off, -1) + k_stride) // k_stride, k_len)
        n_end = tl.minimum((tl.maximum(q_hi - k_off, -1) + k_stride) // k_stride, k_len)
    else:
        n_first = k_len
        n_end = k_len
    n_full = (n_first // BLOCK_N) * BLOCK_N  # tiles before this are visible to every query of the tile

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_base = K + kh * stride_kh
    v_base = V + kh * stride_vh
    block_row = block_table + b * stride_bt
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, k_start, k_len, k_off, k_stride, block_row,
        stride_kt, stride_kblk, stride_vt, stride_vblk, 0, n_full, qk_scale,
        CAUSAL, False, PAGED, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, k_start, k_len, k_off, k_stride, block_row,
        stride_kt, stride_kblk, stride_vt, stride_vblk, n_full, n_end, qk_scale,
        CAUSAL, True, PAGED, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> ln
    tl.store(Lse + heads.to(tl.int64) * stride_lh + q_start + offs_m, lse, mask=m_mask)


def default_blocks(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts rows (query tokens x heads of a KV group)."""
    if device.type != "cuda":
        return 64, 32, 4, 1  # the interpreter: small tiles
    if dtype == torch.float32:  # IEEE dots: small tiles (H200 sweep, bench/results/attention_gpu_sweep_fp32.json:
        return 32, 32, 4, 2  # 8.1-8.5 TFLOP/s at head_dim 128 where (64, 32, 4, 2) spilled to 0.9-1.0)
    if head_dim <= 64:  # H100 sweeps (bench/results/attention_gpu.json): within noise of the best at 8k-32k
        return 128, 64, 8, 3
    return 128, 128, 8, 3


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def _offsets(value: int | Tensor, batch: int, device: torch.device, name: str) -> Tensor:
    if isinstance(value, Tensor):
        if value.shape != (batch,):
            raise ValueError(f"{name} must be an int or a [{batch}] tensor, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.int32)
    return torch.full((batch,), int(value), dtype=torch.int32, device=device)


def launch_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    k_lens: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    max_seqlen_q: int,
    *,
    causal: bool,
    q_stride: int,
    k_stride: int,
    scale: float,
    block_table: Tensor | None,
    block_m: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> None:
    """Launch the forward kernel. Contiguous: k/v `[Tk, Hkv, D]`, k_lens = cu_seqlens_k `[B+1]`.

    Paged (`block_table` given): k/v `[num_blocks, page, Hkv, D]`, k_lens = seq_lens `[B]`.
    cu_seqlens_q int32 `[B+1]`, offsets int32 `[B]`; out `[Tq, Hq, D]` and lse `[Hq, Tq]` are written in place.
    """
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[-2]
    batch = q_offsets.shape[0]
    bm, bn, warps, stages = default_blocks(d, q.dtype, q.device)
    bm, bn = block_m or bm, block_n or bn
    _check_block("block_q", bm)
    _check_block("block_k", bn)
    if max_seqlen_q == 0 or batch == 0 or hq == 0:
        return
    paged = block_table is not None
    if paged:
        kv_strides = (k.stride(1), k.stride(2), k.stride(0), v.stride(1), v.stride(2), v.stride(0))
        table, table_stride, page = block_table, block_table.stride(0), k.shape[1]
    else:
        kv_strides = (k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1), 0)
        table, table_stride, page = cu_seqlens_q, 0, 1  # unused
    group = hq // hkv
    bm = max(bm, next_pow2(group))
    tokens_m = bm // group
    grid = (-(-max_seqlen_q // tokens_m), batch, hkv)
    _attn_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        k_lens,
        q_offsets,
        k_offsets,
        table,
        q.stride(0),
        q.stride(1),
        *kv_strides,
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        table_stride,
        q_stride,
        k_stride,
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=d,
        HEAD_DIM_PAD=head_dim_pad(d),
        BLOCK_M=bm,
        TOKENS_M=tokens_m,
        BLOCK_N=bn,
        CAUSAL=causal,
        PAGED=paged,
        PAGE_SIZE=page,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    q_offset: int | Tensor = 0,
    k_offset: int | Tensor = 0,
    q_stride: int = 1,
    k_stride: int = 1,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Exact attention with positional causal masking and variable-length batches (Triton).

    Same contract as `spindle_attention.reference.attention_fwd`: q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`,
    optional `cu_seqlens_q`/`cu_seqlens_k` (int `[B+1]`) for packed sequences, offsets as ints or per-sequence
    `[B]` tensors, strides >= 1. Returns `out [Tq, Hq, D]` in q's dtype and `lse [Hq, Tq]` fp32 (None when
    `return_lse=False`). A query that sees no key gets `(0, -inf)`.

    `block_q`/`block_k` are the kernel's BLOCK_M/BLOCK_N tiles (powers of two >= 16; default by head_dim and
    dtype). A BLOCK_M tile holds `block_q // G` query tokens times the G query heads of one KV head (G = Hq // Hkv).
    `num_warps`/`num_stages` override the launch configuration.

    Explicit `q_positions`/`k_positions` raise NotImplementedError: the kernel derives positions from
    offset/stride, which is what lets it skip future key tiles without reading any positions.
    """
    if q_positions is not None or k_positions is not None:
        raise NotImplementedError("explicit q_positions/k_positions are not supported by the Triton kernel")
    _check_qkv(q, k, v)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if q_stride < 1 or k_stride < 1:
        raise ValueError(f"strides must be >= 1, got q_stride={q_stride}, k_stride={k_stride}")
    check_device(q, k, v)
    tq, hq, d = q.shape
    _, q_lens = _split(cu_seqlens_q, tq)
    _, k_lens = _split(cu_seqlens_k, k.shape[0])
    if len(q_lens) != len(k_lens):
        raise ValueError(f"{len(q_lens)} query sequences but {len(k_lens)} key sequences")
    batch = len(q_lens)
    device = q.device
    if cu_seqlens_q is None:
        cu_q = torch.tensor([0, tq], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=device)
    else:
        cu_q = cu_seqlens_q.to(device=device, dtype=torch.int32)
        cu_k = cu_seqlens_k.to(device=device, dtype=torch.int32)
    q_offsets = _offsets(q_offset, batch, device, "q_offset")
    k_offsets = _offsets(k_offset, batch, device, "k_offset")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    # every row is written by the kernel, empty ones as (0, -inf)
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=device)  # [Tq, Hq, D]
    lse = torch.empty(hq, tq, dtype=torch.float32, device=device)  # [Hq, Tq]
    launch_fwd(
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        q_offsets,
        k_offsets,
        max(q_lens, default=0),
        causal=causal,
        q_stride=q_stride,
        k_stride=k_stride,
        scale=scale,
        block_table=None,
        block_m=block_q,
        block_n=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, (lse if return_lse else None)
