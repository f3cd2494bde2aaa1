"""Triton kernels merging partial attention states (same semantics as `spindle_attention.merge`).

A state is `(out [tokens, heads, head_dim], lse [heads, tokens] fp32)`; an empty state is `(0, -inf)` and
merging empty states gives an empty state, never NaN. One program merges one (token, head) row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ._jit import check_device, head_dim_pad, last_dim_contiguous, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound at the first launch (see _jit.LazyKernel), so importing needs no triton
    import triton.language as tl


@lazy_jit
def _merge2_kernel(
    out_a,
    lse_a,
    out_b,
    lse_b,
    out,
    lse,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_lat,
    stride_lah,
    stride_lbt,
    stride_lbh,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    la = tl.load(lse_a + h * stride_lah + t * stride_lat).to(tl.float32)
    lb = tl.load(lse_b + h * stride_lbh + t * stride_lbt).to(tl.float32)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: exp() below gives 0 instead of NaN
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    safe = tl.where(total > 0, total, 1.0)
    oa = tl.load(out_a + t * stride_at + h * stride_ah + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    ob = tl.load(out_b + t * stride_bt + h * stride_bh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    o = oa * (wa / safe) + ob * (wb / safe)
    tl.store(out + t * stride_ot + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_mask)
    tl.store(lse + h * stride_lh + t * stride_lt, tl.where(total > 0, m + tl.log(safe), float("-inf")))


@lazy_jit
def _merge_many_kernel(
    outs,
    lses,
    out,
    lse,
    n_states,
    stride_sn,
    stride_st,
    stride_sh,
    stride_ln,
    stride_lht,
    stride_lhh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse_row = lses + h * stride_lhh + t * stride_lht
    # Pass 1: the largest LSE of the row.
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_states, BLOCK_S):
        s_mask = s0 + offs_s < n_states
        ls = tl.load(lse_row + (s0 + offs_s).to(tl.int64) * stride_ln, mask=s_mask, other=float("-inf"))
        m_vec = tl.maximum(m_vec, ls.to(tl.float32))
    m = tl.max(m_vec, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: weighted sum of the states.
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    w_vec = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, n_states, BLOCK_S):
        s_idx = (s0 + offs_s).to(tl.int64)
        s_mask = s0 + offs_s < n_states
        ls = tl.load(lse_row + s_idx * stride_ln, mask=s_mask, other=float("-inf")).to(tl.float32)
        w = tl.exp(ls - m)  # [BLOCK_S]
        ptrs = outs + s_idx[:, None] * stride_sn + t * stride_st + h * stride_sh + offs_d[None, :]
        o = tl.load(ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, D]
        acc += tl.sum(o * w[:, None], axis=0)
        w_vec += w
    total = tl.sum(w_vec, axis=0)
    safe = tl.where(total > 0, total, 1.0)
    tl.store(out + t * stride_ot + h * stride_oh + offs_d, (acc / safe).to(out.dtype.element_ty), mask=d_mask)
    tl.store(lse + h * stride_lh + t * stride_lt, tl.where(total > 0, m + tl.log(safe), float("-inf")))


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial states over disjoint key sets. Returns `(out, lse)`; `out` in `out_a.dtype`.

    out_a/out_b `[tokens, heads, head_dim]`, lse_a/lse_b `[heads, tokens]`; the result's lse is fp32.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"shape mismatch: {out_a.shape}/{lse_a.shape} vs {out_b.shape}/{lse_b.shape}")
    if out_a.dim() != 3 or lse_a.shape != (out_a.shape[1], out_a.shape[0]):
        raise ValueError(f"expected out [T,H,D] and lse [H,T], got {tuple(out_a.shape)}, {tuple(lse_a.shape)}")
    check_device(out_a, lse_a, out_b, lse_b)
    t, h, d = out_a.shape
    out_a, out_b = last_dim_contiguous(out_a), last_dim_contiguous(out_b)
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)  # [tokens, heads, head_dim]
    lse = torch.empty(h, t, dtype=torch.float32, device=out_a.device)  # [heads, tokens]
    if t == 0 or h == 0:
        return out, lse
    _merge2_kernel[(t, h)](
        out_a,
        lse_a,
        out_b,
        lse_b,
        out,
        lse,
        out_a.stride(0),
        out_a.stride(1),
        out_b.stride(0),
        out_b.stride(1),
        out.stride(0),
        out.stride(1),
        lse_a.stride(1),
        lse_a.stride(0),
        lse_b.stride(1),
        lse_b.stride(0),
        lse.stride(1),
        lse.stride(0),
        HEAD_DIM=d,
        HEAD_DIM_PAD=head_dim_pad(d),
        num_warps=1,
    )
    return out, lse


def merge_attn_states_many(
    outs: Tensor | list[Tensor], lses: Tensor | list[Tensor], *, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Merge N partial states: `outs` `[N, tokens, heads, head_dim]`, `lses` `[N, heads, tokens]`.

    Returns `out [tokens, heads, head_dim]` (in `outs.dtype`, or `out_dtype`) and `lse [heads, tokens]` fp32.
    """
    if isinstance(outs, list | tuple):
        if not outs:
            raise ValueError("merge_attn_states_many needs at least one state")
        outs = torch.stack(list(outs))
        lses = torch.stack(list(lses))
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[0] != lses.shape[0]:
        raise ValueError(f"expected outs [N,T,H,D] and lses [N,H,T], got {tuple(outs.shape)}, {tuple(lses.shape)}")
    n, t, h, d = outs.shape
    if lses.shape[1:] != (h, t):
        raise ValueError(f"lses {tuple(lses.shape)} do not match outs {tuple(outs.shape)}")
    if n == 0:
        raise ValueError("merge_attn_states_many needs at least one state")
    check_device(outs, lses)
    outs = last_dim_contiguous(outs)
    out = torch.empty(t, h, d, dtype=out_dtype or outs.dtype, device=outs.device)  # [tokens, heads, head_dim]
    lse = torch.empty(h, t, dtype=torch.float32, device=outs.device)  # [heads, tokens]
    if t == 0 or h == 0:
        return out, lse
    _merge_many_kernel[(t, h)](
        outs,
        lses,
        out,
        lse,
        n,
        outs.stride(0),
        outs.stride(1),
        outs.stride(2),
        lses.stride(0),
        lses.stride(2),
        lses.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(1),
        lse.stride(0),
        HEAD_DIM=d,
        HEAD_DIM_PAD=head_dim_pad(d),
        BLOCK_S=min(max(next_pow2(n), 2), 16),
        num_warps=1 if d <= 64 else 2,
    )
    return out, lse
