"""A deliberately naive attention (full score matrix, float64) used as the oracle in tests."""

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
