"""Exact attention in torch: the reference every kernel is tested against, and what the CPU engine runs.

Conventions: token-major `[tokens, heads, head_dim]`; GQA by head groups (query head h uses KV head
h // (Hq // Hkv)); LSE is natural-log, fp32, `[heads, tokens]`; a query that sees no key gets
`(out=0, lse=-inf)`.

Causality is decided by explicit positions, not by indices: query i may see key j iff
`k_pos[j] <= q_pos[i]`. Positions are `offset + index * stride` (or explicit tensors), so a chunk can attend
to a history cache (`q_offset = history length`) and a striped shard to another shard (`stride = world`).

Work is tiled over queries and keys (`block_q` x `block_k`) and partial tiles are merged with the
log-sum-exp rule, so memory stays bounded at any sequence length: tiles fully above the diagonal are
skipped, fully visible tiles run without a mask.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .merge import merge_attn_states

BLOCK_Q = 1024
BLOCK_K = 1024

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# Loads keys/values for the key index range [start, end) of one sequence: ([n, Hkv, D], [n, Hkv, D]).
KVLoader = Callable[[int, int], tuple[Tensor, Tensor]]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim differs: q {q.shape[2]} vs k {k.shape[2]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")


def positions(offset: int, length: int, stride: int = 1, device: torch.device | None = None) -> Tensor:
    """Positions `offset + i * stride` for i in [0, length), int64."""
    return torch.arange(length, dtype=torch.int64, device=device) * stride + offset


def _tile(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Dense attention of one tile. q [Tq, Hq, D], k/v [Tk, Hkv, D], bias [Tq, Tk] additive (0 / -inf).

    Returns out [Tq, Hq, D] (q dtype) and lse [Hq, Tq] fp32. Rows that are fully masked are fixed up by the
    caller.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # Fold query groups into the query axis so each KV head is read once: [1, Hkv, G*Tq, D].
    qf = q.reshape(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * tq, d)
    kf = k.permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, Tk, D]
    vf = v.permute(1, 0, 2).unsqueeze(0)
    mask = None if bias is None else bias.to(q.dtype).repeat(g, 1)  # [G*Tq, Tk]
    if _flash_cpu is not None and q.device.type == "cpu":
        out, lse = _flash_cpu(qf, kf, vf, 0.0, False, attn_mask=mask, scale=scale)
    else:
        s = torch.matmul(qf.float(), kf.float().transpose(-1, -2)) * scale
        if mask is not None:
            s = s + mask.float()
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), vf.float()).to(q.dtype)
    out = out.reshape(hkv, g, tq, d).permute(2, 0, 1, 3).reshape(tq, hq, d)
    return out, lse.float().reshape(hq, tq)


def _attend_one(
    q: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    load_kv: KVLoader,
    causal: bool,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """Tiled exact attention for one sequence whose keys come from `load_kv`."""
    tq, hq, d = q.shape
    tk = k_pos.shape[0]
    out = q.new_zeros(tq, hq, d)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or tk == 0:
        return out, lse
    q_blocks = [(s, min(s + block_q, tq)) for s in range(0, tq, block_q)]
    k_blocks = [(s, min(s + block_k, tk)) for s in range(0, tk, block_k)]
    # Per-block position ranges, fetched to the host once.
    q_lo = [int(x) for x in torch.stack([q_pos[s:e].min() for s, e in q_blocks]).tolist()]
    q_hi = [int(x) for x in torch.stack([q_pos[s:e].max() for s, e in q_blocks]).tolist()]
    k_lo = [int(x) for x in torch.stack([k_pos[s:e].min() for s, e in k_blocks]).tolist()]
    k_hi = [int(x) for x in torch.stack([k_pos[s:e].max() for s, e in k_blocks]).tolist()]
    kv_cache: dict[int, tuple[Tensor, Tensor]] = {}
    for qi, (qs, qe) in enumerate(q_blocks):
        acc: tuple[Tensor, Tensor] | None = None
        for ki, (ks, ke) in enumerate(k_blocks):
            if causal and k_lo[ki] > q_hi[qi]:
                continue  # every key is in every query's future
            kv = kv_cache.get(ki)
            if kv is None:
                kv = load_kv(ks, ke)
                if len(q_blocks) > 1:
                    kv_cache[ki] = kv
            bias = None
            if causal and k_hi[ki] > q_lo[qi]:
                visible = k_pos[ks:ke].unsqueeze(0) <= q_pos[qs:qe].unsqueeze(1)  # [bq, bk]
                bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
                bias.masked_fill_(~visible, float("-inf"))
            part = _tile(q[qs:qe], kv[0], kv[1], bias, scale)
            if bias is not None:
                empty = ~visible.any(dim=1)  # [bq] rows with no visible key in this tile
                if bool(empty.any()):
                    part[0][empty] = 0
                    part[1][:, empty] = float("-inf")
            acc = part if acc is None else merge_attn_states(acc[0], acc[1], part[0], part[1])
        if acc is not None:
            out[qs:qe] = acc[0]
            lse[:, qs:qe] = acc[1]
    return out, lse


def _as_positions(
    explicit: Tensor | None, offset: int | Tensor, stride: int, starts: list[int], lengths: list[int], device
) -> list[Tensor]:
    if explicit is not None:
        return [explicit[s : s + n].to(device=device, dtype=torch.int64) for s, n in zip(starts, lengths, strict=True)]
    offsets = offset.tolist() if isinstance(offset, Tensor) else [offset] * len(lengths)
    if len(offsets) != len(lengths):
        raise ValueError(f"got {len(offsets)} offsets for {len(lengths)} sequences")
    return [positions(int(o), n, stride, device) for o, n in zip(offsets, lengths, strict=True)]


def _split(cu_seqlens: Tensor | None, total: int) -> tuple[list[int], list[int]]:
    if cu_seqlens is None:
        return [0], [total]
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {cu}")
    return cu[:-1], [b - a for a, b in itertools.pairwise(cu)]


def _can_use_sdpa_causal(q_pos: Tensor, k_pos: Tensor) -> bool:
    """True when the mask is plain top-left causal over equal-length, identically placed q and k."""
    return (
        q_pos.shape == k_pos.shape
        and bool(torch.equal(q_pos, k_pos))
        and bool((q_pos.numel() < 2) or torch.all(q_pos[1:] > q_pos[:-1]))
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
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[Tensor, Tensor | None]:
    """Exact attention with positional causal masking and variable-length batches.

    q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`. With `cu_seqlens_q`/`cu_seqlens_k` (int, `[B+1]`) the tokens are
    B packed sequences that attend only within themselves; offsets may then be per-sequence tensors `[B]`.
    `q_positions`/`k_positions` (int `[T]`, per packed token) override offset/stride.

    Returns `out [Tq, Hq, D]` in q's dtype and `lse [Hq, Tq]` fp32 (None when `return_lse=False`, which
    lets the plain causal case run as one `scaled_dot_product_attention`).
    """
    _check_qkv(q, k, v)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_starts, q_lens = _split(cu_seqlens_q, q.shape[0])
    k_starts, k_lens = _split(cu_seqlens_k, k.shape[0])
    if len(q_lens) != len(k_lens):
        raise ValueError(f"{len(q_lens)} query sequences but {len(k_lens)} key sequences")
    q_pos = _as_positions(q_positions, q_offset, q_stride, q_starts, q_lens, q.device)
    k_pos = _as_positions(k_positions, k_offset, k_stride, k_starts, k_lens, q.device)

    outs, lses = [], []
    for qs, nq, ks, nk, qp, kp in zip(q_starts, q_lens, k_starts, k_lens, q_pos, k_pos, strict=True):
        qb = q[qs : qs + nq]
        kb, vb = k[ks : ks + nk], v[ks : ks + nk]
        if not return_lse and causal and nq > 0 and _can_use_sdpa_causal(qp, kp):
            # 4-D inputs: CPU picks its flash kernel only for [batch, heads, tokens, head_dim].
            o = F.scaled_dot_product_attention(
                qb.transpose(0, 1).unsqueeze(0),
                kb.transpose(0, 1).unsqueeze(0),
                vb.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
            outs.append(o)
            continue
        o, lse = _attend_one(qb, qp, kp, lambda s, e, kb=kb, vb=vb: (kb[s:e], vb[s:e]), causal, scale, block_q, block_k)
        outs.append(o)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    if not return_lse:
        return out, None
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return out, lse
