"""Attention over a block-paged KV cache (torch path).

Cache layout: `k_cache`, `v_cache` are `[num_blocks, block_size, Hkv, D]`; a sequence's token t lives in
block `block_table[t // block_size]` at offset `t % block_size`.

- `paged_decode`: one query token per sequence over its whole cached context, split-KV
  (flash-decoding): the context is cut into `num_splits` ranges whose partial states are merged.
- `paged_prefill`: a chunk of queries per sequence over its cached history plus the chunk itself (the
  chunk's KV must already be written to the cache), as chunked prefill needs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .merge import merge_attn_states_many
from .reference import BLOCK_K, BLOCK_Q, _attend_one, _split, positions

# Keys gathered at once per sequence in the torch decode path; longer contexts are split further.
DECODE_SPLIT_TOKENS = 8192


def _check_cache(k_cache: Tensor, v_cache: Tensor, block_table: Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [blocks, block_size, Hkv, D]; got {k_cache.shape}, {v_cache.shape}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [batch, max_blocks]; got {tuple(block_table.shape)}")


def slot_indices(block_table: Tensor, block_size: int, start: int, end: int) -> Tensor:
    """Flat cache slots of token indices [start, end) for every row of `block_table`: `[B, end-start]`."""
    tok = torch.arange(start, end, device=block_table.device)
    blocks = block_table.index_select(1, tok // block_size).long()  # [B, n]
    return blocks * block_size + tok % block_size


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    num_splits: int | None = None,
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """q `[B, Hq, D]` (one token per sequence, attending to all `seq_lens[b]` cached tokens).

    Returns `out [B, Hq, D]` and `lse [Hq, B]` fp32. A sequence with `seq_len == 0` gets `(0, -inf)`.
    `num_splits=None` picks enough splits to keep each gather under DECODE_SPLIT_TOKENS keys.
    """
    _check_cache(k_cache, v_cache, block_table)
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"batch mismatch: q {b}, block_table {block_table.shape[0]}, seq_lens {seq_lens.shape}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    g = hq // hkv
    max_len = int(seq_lens.max()) if b else 0
    if max_len > block_table.shape[1] * block_size:
        raise ValueError(f"seq_len {max_len} exceeds block_table capacity {block_table.shape[1] * block_size}")
    if num_splits is None:
        num_splits = max(1, math.ceil(max_len / DECODE_SPLIT_TOKENS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = max(1, math.ceil(max_len / num_splits))
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    qg = q.view(b, hkv, g, d).float()  # [B, Hkv, G, D]
    outs, lses = [], []
    for start in range(0, max(max_len, 1), split):
        end = min(start + split, max_len)
        slots = slot_indices(block_table, block_size, start, end)  # [B, n]
        keys = k_flat[slots].float()  # [B, n, Hkv, D]
        vals = v_flat[slots].float()
        s = torch.einsum("bhgd,bnhd->bhgn", qg, keys) * scale
        valid = torch.arange(start, end, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, n]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G]
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        o = torch.einsum("bhgn,bnhd->bhgd", torch.exp(s - safe.unsqueeze(-1)), vals)
        outs.append(o.reshape(b, hq, d))
        lses.append(lse.reshape(b, hq).transpose(0, 1))
    if len(outs) == 1:
        return outs[0].to(q.dtype), lses[0].contiguous()
    out, lse = merge_attn_states_many(outs, lses)
    return out.to(q.dtype), lse


def paged_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    softmax_scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[Tensor, Tensor]:
    """Chunked prefill over paged history. q `[Tq, Hq, D]` packs B chunks (`cu_seqlens_q`, `[B+1]`).

    Sequence b has `seq_lens[b]` tokens cached, its chunk being the last `n_b` of them, so its queries sit
    at positions `seq_lens[b] - n_b ...` and attend causally to everything cached before them.
    Keys are gathered from the cache one `block_k` tile at a time. Returns `out [Tq, Hq, D]`, `lse [Hq, Tq]`.
    """
    _check_cache(k_cache, v_cache, block_table)
    _, block_size, hkv, d = k_cache.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    starts, lens = _split(cu_seqlens_q, q.shape[0])
    totals = [int(x) for x in seq_lens.tolist()]
    if len(totals) != len(lens) or block_table.shape[0] != len(lens):
        raise ValueError(f"{len(lens)} chunks but {len(totals)} seq_lens / {block_table.shape[0]} block rows")
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    outs, lses = [], []
    for i, (qs, n, total) in enumerate(zip(starts, lens, totals, strict=True)):
        if n > total:
            raise ValueError(f"chunk of {n} tokens longer than the {total} cached for sequence {i}")
        row = block_table[i : i + 1]

        def load(s: int, e: int, row: Tensor = row) -> tuple[Tensor, Tensor]:
            slots = slot_indices(row, block_size, s, e)[0]
            return k_flat[slots], v_flat[slots]

        q_pos = positions(total - n, n, device=q.device)
        k_pos = positions(0, total, device=q.device)
        o, lse = _attend_one(q[qs : qs + n], q_pos, k_pos, load, True, scale, block_q, block_k)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
