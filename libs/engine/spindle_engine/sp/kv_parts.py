"""The KV hand-off after SP prefill: each holder sends each decode rank only that rank's heads.

A holder's KV is `[2, layers, n, Hkv, D]` for its positions (any order). For a decode instance of tensor-
parallel size T, decode rank t owns the KV heads `TPShard.create(config, t, T).kv_heads`; the holder
slices them out, so the sequence-sharded prefill layout becomes the head-sharded decode layout in the one
transfer. The receiver puts every holder's part in place by position (`assemble_kv`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from spindle_model import ModelConfig
from spindle_model.parallel import TPShard


def decode_heads(config: ModelConfig, tp_size: int) -> list[tuple[int, int]]:
    """`[start, end)` KV heads of each decode TP rank."""
    return [TPShard.create(config, t, tp_size).kv_heads for t in range(tp_size)]


def split_for_decode(kv: Tensor, heads: list[tuple[int, int]]) -> list[Tensor]:
    """One contiguous `[2, layers, n, h_t, D]` part per decode rank."""
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(f"KV must be [2, layers, tokens, kv_heads, head_dim], got {tuple(kv.shape)}")
    if not heads or heads[0][0] != 0 or heads[-1][1] != kv.shape[3]:
        raise ValueError(f"head ranges {heads} do not cover the {kv.shape[3]} KV heads")
    return [kv[:, :, :, lo:hi].contiguous() for lo, hi in heads]


def assemble_kv(parts: list[tuple[Tensor, Tensor]], num_tokens: int) -> Tensor:
    """`[(positions [n_i], kv [2, L, n_i, H, D]), ...]` -> `[2, L, num_tokens, H, D]`; every position exactly once."""
    if not parts:
        raise ValueError("no KV parts to assemble")
    shape = parts[0][1].shape
    out = torch.empty(2, shape[1], num_tokens, shape[3], shape[4], dtype=parts[0][1].dtype, device=parts[0][1].device)
    seen = torch.zeros(num_tokens, dtype=torch.int64)
    for pos, kv in parts:
        if kv.dim() != 5 or kv.shape[:2] != shape[:2] or kv.shape[3:] != shape[3:] or kv.shape[2] != pos.numel():
            raise ValueError(f"KV part {tuple(kv.shape)} does not fit {tuple(shape)} with {pos.numel()} positions")
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= num_tokens):
            raise ValueError(f"KV part positions fall outside [0, {num_tokens})")
        out.index_copy_(2, pos.to(out.device), kv)
        seen.index_add_(0, pos, torch.ones_like(pos))
    if not bool((seen == 1).all()):
        bad = (seen != 1).nonzero().flatten()
        raise ValueError(f"{bad.numel()} positions are missing or repeated in the KV parts (first: {bad[:8].tolist()})")
    return out
