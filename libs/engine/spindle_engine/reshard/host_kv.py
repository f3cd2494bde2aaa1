"""The shared host-memory KV tier between the prefill and the decode configuration (Seesaw Fig. 7): one request's
KV as `[layers, 2, kv_heads, tokens, head_dim]` (HND: a head's tokens contiguous) in a file every process maps with
`MAP_SHARED`. A prefill rank pushes its layers x its KV heads; a decode rank pulls every layer x its KV heads. Each
side moves exactly its shard, so over the group each side moves the whole KV once; the counters say so."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor


class HostKV:
    def __init__(
        self, path: Path, layers: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype, create: bool
    ) -> None:
        self.shape = (layers, 2, kv_heads, tokens, head_dim)
        nbytes = layers * 2 * kv_heads * tokens * head_dim * dtype.itemsize
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        flat = torch.from_file(str(path), shared=True, size=nbytes // dtype.itemsize, dtype=dtype)
        self.kv = flat.view(self.shape)  # [L, 2, Hkv, T, D]
        self.pushed = self.pulled = 0  # bytes this process moved

    def push(self, layer: int, heads: tuple[int, int], start: int, k: Tensor, v: Tensor) -> None:
        """k, v `[tokens, heads, head_dim]` (the model's layout) of tokens [start, start + tokens)."""
        t = k.shape[0]
        self.kv[layer, 0, heads[0] : heads[1], start : start + t].copy_(k.transpose(0, 1))
        self.kv[layer, 1, heads[0] : heads[1], start : start + t].copy_(v.transpose(0, 1))
        self.pushed += 2 * k.numel() * k.element_size()

    def pull(self, layer: int, heads: tuple[int, int], tokens: int, k_out: Tensor, v_out: Tensor) -> None:
        """Into `k_out`, `v_out` `[heads, >= tokens, head_dim]` (HND): the layer's first `tokens` tokens."""
        k_out[:, :tokens].copy_(self.kv[layer, 0, heads[0] : heads[1], :tokens])
        v_out[:, :tokens].copy_(self.kv[layer, 1, heads[0] : heads[1], :tokens])
        self.pulled += 2 * (heads[1] - heads[0]) * tokens * self.shape[4] * self.kv.element_size()

    @staticmethod
    def nbytes(layers: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> int:
        """The whole KV of `tokens` tokens: what each side moves over the group."""
        return layers * 2 * kv_heads * tokens * head_dim * dtype.itemsize
