"""Merging partial attention states.

A partial state is `(out, lse)`: `out` is `[tokens, heads, head_dim]`, softmax-normalised over the keys it
saw, and `lse` is `[heads, tokens]` fp32, the natural-log sum of exp(scores) over those keys. A row that saw
no key is `(0, -inf)`. Merging is exact: the result equals attention over the union of the key sets.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _finite_max(lse: Tensor, dim: int | None = None) -> Tensor:
    m = lse if dim is None else lse.amax(dim=dim)
    # A row where every state is empty has max -inf; shifting by 0 keeps exp() at 0 instead of NaN.
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial states over disjoint key sets. Returns `(out, lse)`; `out` in `out_a.dtype`."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"shape mismatch: {out_a.shape}/{lse_a.shape} vs {out_b.shape}/{lse_b.shape}")
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = _finite_max(torch.maximum(lse_a, lse_b))
    w_a = torch.exp(lse_a - m)  # [heads, tokens]
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)  # log(0) = -inf keeps empty rows empty
    safe = torch.where(total > 0, total, torch.ones_like(total))
    scale_a = (w_a / safe).transpose(0, 1).unsqueeze(-1)  # [tokens, heads, 1]
    scale_b = (w_b / safe).transpose(0, 1).unsqueeze(-1)
    out = out_a.float() * scale_a + out_b.float() * scale_b
    return out.to(out_a.dtype), lse


def merge_attn_states_many(outs: Tensor | list[Tensor], lses: Tensor | list[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge N partial states: `outs` `[N, tokens, heads, head_dim]`, `lses` `[N, heads, tokens]`."""
    if isinstance(outs, list | tuple):
        if not outs:
            raise ValueError("merge_attn_states_many needs at least one state")
        outs = torch.stack(list(outs))
        lses = torch.stack(list(lses))
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[0] != lses.shape[0]:
        raise ValueError(f"expected outs [N,T,H,D] and lses [N,H,T], got {tuple(outs.shape)}, {tuple(lses.shape)}")
    lses = lses.float()
    m = _finite_max(lses, dim=0)  # [heads, tokens]
    w = torch.exp(lses - m)  # [N, heads, tokens]
    total = w.sum(dim=0)
    lse = m + torch.log(total)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    scale = (w / safe).transpose(1, 2).unsqueeze(-1)  # [N, tokens, heads, 1]
    out = (outs.float() * scale).sum(dim=0)
    return out.to(outs.dtype), lse
