"""How a chunk's tokens are split over a sequence-parallel group.

`shard_indices(num_tokens, sp, layout)` returns, per rank, the ascending token indices (int64) it holds.
Every layout covers `[0, num_tokens)` exactly once for any `num_tokens >= 0` (ranks may be empty when
`num_tokens < sp`). Balance rules, with `n = num_tokens`:

- `contiguous`: rank r holds one run; run lengths are `n // sp` plus one for the first `n % sp` ranks.
- `stripe` (LoongServe): rank r holds the indices `i` with `i % sp == r`; lengths differ by at most one.
  Under causal attention every rank does nearly the same work (within one row per step).
- `zigzag` (ring-flash-attention): the tokens are cut into `2 * sp` runs (lengths `n // (2 sp)` plus one for
  the first `n % (2 sp)` runs); rank r holds run r and run `2 sp - 1 - r`, pairing an early run with a late
  one so causal work is balanced. Token counts differ by at most one.

Layouts need no special masks: causality comes from each token's absolute position
(`offset + index`, where `offset` is the chunk's start in the prompt), which travels with the token.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Layout = Literal["contiguous", "stripe", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "stripe", "zigzag")


def _runs(n: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, n) into `parts` runs whose lengths differ by at most one (longer runs first)."""
    base, extra = divmod(n, parts)
    runs, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        runs.append((start, start + length))
        start += length
    return runs


def shard_indices(num_tokens: int, sp: int, layout: str) -> list[Tensor]:
    """Per-rank ascending token indices (int64 `[n_r]`) of a `num_tokens` chunk split over `sp` ranks."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if sp < 1:
        raise ValueError(f"sp must be >= 1, got {sp}")
    if layout == "contiguous":
        return [torch.arange(s, e, dtype=torch.int64) for s, e in _runs(num_tokens, sp)]
    if layout == "stripe":
        return [torch.arange(min(r, num_tokens), num_tokens, sp, dtype=torch.int64) for r in range(sp)]
    if layout == "zigzag":
        runs = _runs(num_tokens, 2 * sp)
        out = []
        for r in range(sp):
            (a, b), (c, d) = runs[r], runs[2 * sp - 1 - r]
            out.append(torch.cat([torch.arange(a, b), torch.arange(c, d)]).to(torch.int64))
        return out
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def shard_positions(num_tokens: int, sp: int, layout: str, rank: int, offset: int = 0) -> Tensor:
    """Absolute positions (int64 `[n_r]`) of rank `rank`'s shard of the chunk `[offset, offset + num_tokens)`."""
    if not 0 <= rank < sp:
        raise ValueError(f"rank {rank} out of range for sp={sp}")
    return shard_indices(num_tokens, sp, layout)[rank] + offset


def shard(x: Tensor, sp: int, layout: str, rank: int) -> Tensor:
    """Rank `rank`'s shard of a token-major tensor `x [tokens, ...]` -> `[n_r, ...]`."""
    idx = shard_indices(x.shape[0], sp, layout)[rank].to(x.device)
    return x.index_select(0, idx)


def unshard(shards: list[Tensor], layout: str, dim: int = 0) -> Tensor:
    """Inverse of `shard`: reassemble `[tokens, ...]` from every rank's shard (in rank order) along `dim`."""
    if not shards:
        raise ValueError("unshard needs at least one shard")
    sp = len(shards)
    n = sum(s.shape[dim] for s in shards)
    idx = shard_indices(n, sp, layout)
    for r, (s, i) in enumerate(zip(shards, idx, strict=True)):
        if s.shape[dim] != i.numel():
            raise ValueError(f"shard {r} has {s.shape[dim]} tokens, layout {layout!r} expects {i.numel()}")
    perm = torch.cat(idx).to(shards[0].device)
    full = torch.cat(shards, dim=dim)
    out = torch.empty_like(full)
    out.index_copy_(dim, perm, full)
    return out
