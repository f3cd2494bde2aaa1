"""Test helpers: a deliberately naive attention (full score matrix, float64), the oracle of the tests, and a
builder of paged KV caches."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def naive_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, causal: bool = True, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> out [Tq, Hq, D] float64, lse [Hq, Tq] float64."""
    _tq, hq, d = q.shape
    g = hq // k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, lse


def scatter_paged(seqs: list[Tensor], block_size: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Scatter per-sequence K or V `[len, Hkv, D]` into a shuffled block pool `[blocks, block_size, Hkv, D]`.

    Returns the pool (in the sequences' dtype; the unused rows, partial last blocks included, hold noise) and
    an int64 block table `[B, max_blocks]`. The same seed gives the same block table."""
    hkv, d = seqs[0].shape[1:]
    widths = [-(-len(s) // block_size) for s in seqs]
    num_blocks = sum(widths) + 3
    noise = torch.randn(num_blocks, block_size, hkv, d, generator=torch.Generator().manual_seed(seed + 1))
    cache = noise.to(seqs[0].dtype)
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(len(seqs), max(max(widths), 1), dtype=torch.int64)
    for i, s in enumerate(seqs):
        for j in range(widths[i]):
            block = free.pop()
            table[i, j] = block
            part = s[j * block_size : (j + 1) * block_size]
            cache[block, : len(part)] = part
    return cache, table
