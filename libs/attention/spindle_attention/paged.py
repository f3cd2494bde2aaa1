"""Attention over a block-paged KV cache (torch path).

Cache layout: `k_cache`, `v_cache` are `[num_blocks, block_size, Hkv, D]`; a sequence's token t lives in
block `block_table[t // block_size]` at offset `t % block_size`.

- `paged_decode`: one query token per sequence over its whole cached context, split-KV
  (flash-decoding): the context is cut into `num_splits` ranges whose partial states are merged.
- `paged_prefill`: a chunk of queries per sequence over its cached history plus the chunk itself (the
  chunk's KV must already be written to the cache), as chunked prefill needs. On CPU: the native kernel
  (`cpu.prefill`, K/V read in place, GQA folded) where it is built, else two flash-attention calls per sequence
  (the history unmasked, the chunk causal) merged by LSE; elsewhere the tiled reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu import decode as cpu_decode
from .cpu import prefill as cpu_prefill
from .merge import merge_attn_states, merge_attn_states_many
from .reference import BLOCK_K, BLOCK_Q, _attend_one, _flash_cpu, _split, positions

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
    return_lse: bool = True,
    native: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """q `[B, Hq, D]` (one token per sequence, attending to all `seq_lens[b]` cached tokens).

    Returns `out [B, Hq, D]` and `lse [Hq, B]` fp32 (None with `return_lse=False`, which runs each split as
    one `scaled_dot_product_attention`). A sequence with `seq_len == 0` gets `(0, -inf)`. The context is cut
    into `num_splits` block-aligned ranges; None picks enough to keep each under DECODE_SPLIT_TOKENS keys, or,
    on a CPU with Spindle's kernels (`spindle_attention.cpu`), runs the native kernel, which splits by itself.
    `native=False` keeps the torch path even there (the `reference` attention backend).
    """
    _check_cache(k_cache, v_cache, block_table)
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"batch mismatch: q {b}, block_table {block_table.shape[0]}, seq_lens {tuple(seq_lens.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    max_len = int(seq_lens.max()) if b else 0
    if max_len > block_table.shape[1] * block_size:
        raise ValueError(f"seq_len {max_len} exceeds block_table capacity {block_table.shape[1] * block_size}")
    if native and num_splits is None and cpu_decode.supported(q, k_cache, v_cache):
        out, lse = cpu_decode.DecodeBatch(block_table, seq_lens, hkv).run(q, k_cache, v_cache, scale)
        return out.to(q.dtype), (lse if return_lse else None)
    num_blocks = max(1, -(-max_len // block_size))
    if num_splits is None:
        num_splits = max(1, math.ceil(max_len / DECODE_SPLIT_TOKENS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    per_split = -(-num_blocks // num_splits)
    table = block_table[:, :num_blocks].long()
    outs, lses = [], []
    for first in range(0, num_blocks, per_split):
        last = min(first + per_split, num_blocks)
        n = (last - first) * block_size
        # Gather whole blocks (contiguous rows of the pool), not single tokens.
        ids = table[:, first:last].reshape(-1)
        keys = k_cache.index_select(0, ids).view(b, n, hkv, d)  # [B, n, Hkv, D]
        vals = v_cache.index_select(0, ids).view(b, n, hkv, d)
        valid = torch.arange(first * block_size, last * block_size, device=q.device) < seq_lens.unsqueeze(1)  # [B, n]
        if not return_lse and num_splits == 1:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys.transpose(1, 2),
                vals.transpose(1, 2),
                attn_mask=valid[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )[:, :, 0]  # [B, Hq, D]
            if b and bool((seq_lens == 0).any()):
                out = out.masked_fill((seq_lens == 0)[:, None, None], 0.0)
            return out, None
        qg = q.view(b, hkv, hq // hkv, d).float()  # [B, Hkv, G, D]
        s = torch.einsum("bhgd,bnhd->bhgn", qg, keys.float()) * scale
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G]
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        o = torch.einsum("bhgn,bnhd->bhgd", torch.exp(s - safe.unsqueeze(-1)), vals.float())
        outs.append(o.reshape(b, hq, d))
        lses.append(lse.reshape(b, hq).transpose(0, 1))
    if len(outs) == 1:
        out, lse = outs[0], lses[0].contiguous()
    else:
        out, lse = merge_attn_states_many(outs, lses)
    return out.to(q.dtype), (lse if return_lse else None)


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
    native: bool = True,
) -> tuple[Tensor, Tensor]:
    """Chunked prefill over paged history. q `[Tq, Hq, D]` packs B chunks (`cu_seqlens_q`, `[B+1]`).

    Sequence b has `seq_lens[b]` tokens cached, its chunk being the last `n_b` of them, so its queries sit
    at positions `seq_lens[b] - n_b ...` and attend causally to everything cached before them.
    Keys are gathered from the cache one `block_k` tile at a time. Returns `out [Tq, Hq, D]`, `lse [Hq, Tq]`.
    `native=False` skips the native CPU kernel where it is built (the `reference` attention backend).
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
    native = native and cpu_prefill.supported(q, k_cache, v_cache)
    outs, lses = [], []
    for i, (qs, n, total) in enumerate(zip(starts, lens, totals, strict=True)):
        if n > total:
            raise ValueError(f"chunk of {n} tokens longer than the {total} cached for sequence {i}")
        row = block_table[i : i + 1]
        if native and n > 0:
            o, lse = cpu_prefill.attention(q[qs : qs + n], k_cache, v_cache, row[0], total - n, scale)
            outs.append(o)
            lses.append(lse)
            continue

        def load(s: int, e: int, row: Tensor = row) -> tuple[Tensor, Tensor]:
            slots = slot_indices(row, block_size, s, e)[0]
            return k_flat[slots], v_flat[slots]

        if _flash_cpu is not None and q.device.type == "cpu" and n > 0:
            k, v = load(0, total)
            o, lse = _history_then_chunk(q[qs : qs + n], k, v, total - n, scale)
            outs.append(o)
            lses.append(lse)
            continue
        q_pos = positions(total - n, n, device=q.device)
        k_pos = positions(0, total, device=q.device)
        o, lse = _attend_one(q[qs : qs + n], q_pos, k_pos, load, True, scale, block_q, block_k)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _history_then_chunk(q: Tensor, k: Tensor, v: Tensor, history: int, scale: float) -> tuple[Tensor, Tensor]:
    """CPU flash attention of a chunk `q [n, Hq, D]` at positions history.. over `k`/`v` `[history + n, Hkv, D]`:
    the history with no mask (each KV head read once for its query group) and the chunk's own keys causally (the
    kernel skips the masked half), merged by their log-sum-exps. Returns `out [n, Hq, D]`, `lse [Hq, n]`."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    own_k = k[history:].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    own_v = v[history:].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
    out, lse = _flash_cpu(q.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True, scale=scale)
    out, lse = out[0].transpose(0, 1), lse[0]  # [n, Hq, D], [Hq, n]
    if history == 0:
        return out, lse
    qf = q.reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)  # query groups folded per KV head
    past_k = k[:history].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, history, D]
    past_v = v[:history].permute(1, 0, 2).unsqueeze(0)
    past, past_lse = _flash_cpu(qf, past_k, past_v, 0.0, False, scale=scale)
    past = past[0].reshape(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
    return merge_attn_states(past, past_lse[0].reshape(hq, n), out, lse)
