"""Spindle's positional causal mask in the terms of kernels that align causality to a corner.

Spindle masks by positions: query i sees key j iff `k_pos[j] <= q_pos[i]`, with positions
`offset + index * stride`. With equal strides s and no explicit positions that is `j <= i + d`, where
`d = floor((q_offset - k_offset) / s)`: one shift per sequence. flash-attn aligns its causal mask to the
bottom-right corner (`j <= i + Lk - Lq`) and the native CPU prefill kernel runs a chunk at the end of its keys,
so a sequence maps onto them when `d == Lk - Lq`; when `d >= Lk - 1` every key is in every query's past and
the sequence can run unmasked. Sequences with no queries or no keys fit any mask.
"""

from __future__ import annotations

from torch import Tensor

from .base import FwdArgs, Unsupported


def _per_sequence(offset: int | Tensor, batch: int, name: str) -> list[int]:
    if not isinstance(offset, Tensor):
        return [int(offset)] * batch
    values = [int(x) for x in offset.reshape(-1).tolist()]
    if len(values) != batch:
        raise ValueError(f"got {len(values)} {name}s for {batch} sequences")
    return values


def causal_shifts(args: FwdArgs, batch: int) -> list[int]:
    """Per sequence, the shift d with "query i sees key j iff j <= i + d". Unsupported for explicit positions or
    different query and key strides, which no single shift describes."""
    if args.q_positions is not None or args.k_positions is not None:
        raise Unsupported("explicit q/k positions")
    if args.q_stride != args.k_stride:
        raise Unsupported("different query and key strides")
    q_offsets = _per_sequence(args.q_offset, batch, "q_offset")
    k_offsets = _per_sequence(args.k_offset, batch, "k_offset")
    return [(qo - ko) // args.q_stride for qo, ko in zip(q_offsets, k_offsets, strict=True)]


def all_at_end(shifts: list[int], q_lens: list[int], k_lens: list[int]) -> bool:
    """Every sequence's queries end where its keys end (bottom-right causal alignment)."""
    return all(nq == 0 or nk == 0 or d == nk - nq for d, nq, nk in zip(shifts, q_lens, k_lens, strict=True))


def all_visible(shifts: list[int], q_lens: list[int], k_lens: list[int]) -> bool:
    """Every query of every sequence sees all of its sequence's keys (the mask is a no-op)."""
    return all(nq == 0 or nk == 0 or d >= nk - 1 for d, nq, nk in zip(shifts, q_lens, k_lens, strict=True))
