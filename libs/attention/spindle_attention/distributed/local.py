"""The local attention every sequence-parallel path runs on its shard: Triton on CUDA, torch elsewhere.

Ring, Ulysses and SP-TP call `local_attention` with explicit positions. The torch reference takes them as
they are. The Triton kernel derives positions from `offset + index * stride` (that is what lets it skip
future tiles without reading positions), so on CUDA the positions are cut into *affine runs* first:
contiguous and striped shards are one run, a zigzag shard two, a block with history a few more. Each
(query run, key run) pair is one kernel call, pairs wholly in the queries' future are skipped, and the
partial states are merged with the log-sum-exp rule. Positions that need more than `MAX_RUN_PAIRS` calls
fall back to the reference (correct on any device, only slower).
"""

from __future__ import annotations

from bisect import bisect_right

import torch
from torch import Tensor

from .. import reference
from .. import triton as tri
from ..merge import merge_attn_states

MAX_RUN_PAIRS = 16

# (first index, length, offset, stride): positions[first + i] == offset + i * stride for i < length
Run = tuple[int, int, int, int]


def affine_runs(positions: Tensor, limit: int | None = None) -> list[Run] | None:
    """Cut int positions `[n]` into maximal runs `offset + i * stride` (stride >= 1), in order.

    Returns None once more than `limit` runs are needed."""
    pos = positions.detach().to("cpu", torch.int64)
    n = pos.numel()
    diffs = pos[1:] - pos[:-1]  # [n - 1]
    changes = (torch.nonzero(diffs[1:] != diffs[:-1]).flatten() + 1).tolist()  # diffs[j] != diffs[j - 1]
    runs: list[Run] = []
    i = 0
    while i < n:
        if limit is not None and len(runs) == limit:
            return None
        first = int(pos[i])
        step = int(diffs[i]) if i < n - 1 else 0
        if step < 1:
            runs.append((i, 1, first, 1))
            i += 1
            continue
        # diffs[i:c] are all equal, so positions i..c form one run
        k = bisect_right(changes, i)
        c = changes[k] if k < len(changes) else n - 1
        runs.append((i, c - i + 1, first, step))
        i = c + 1
    return runs


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor, k_positions: Tensor, softmax_scale: float
) -> tuple[Tensor, Tensor]:
    """`attention_fwd(q, k, v)` by positions; returns `(out [Tq, Hq, D], lse [Hq, Tq] fp32)`."""
    if q.is_cuda and tri.available():
        state = triton_by_runs(q, k, v, q_positions, k_positions, softmax_scale)
        if state is not None:
            return state
    out, lse = reference.attention_fwd(
        q, k, v, q_positions=q_positions, k_positions=k_positions, softmax_scale=softmax_scale
    )
    assert lse is not None
    return out, lse


def triton_by_runs(
    q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor, softmax_scale: float
) -> tuple[Tensor, Tensor] | None:
    """The Triton kernel over every (query run, key run) pair, merged; None when there are too many pairs."""
    q_runs = affine_runs(q_positions, MAX_RUN_PAIRS)
    k_runs = affine_runs(k_positions, MAX_RUN_PAIRS)
    if q_runs is None or k_runs is None or len(q_runs) * len(k_runs) > MAX_RUN_PAIRS:
        return None
    tq, hq, d = q.shape
    if len(q_runs) == 1 and len(k_runs) == 1:
        (_, _, qo, qs), (_, _, ko, ks) = q_runs[0], k_runs[0]
        out, lse = tri.attention_fwd(
            q, k, v, q_offset=qo, q_stride=qs, k_offset=ko, k_stride=ks, softmax_scale=softmax_scale
        )
        assert lse is not None
        return out, lse
    out = torch.zeros(tq, hq, d, dtype=q.dtype, device=q.device)  # [Tq, Hq, D]
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)  # [Hq, Tq]
    for qi, qn, qo, qs in q_runs:
        q_last = qo + (qn - 1) * qs
        acc_out = torch.zeros(qn, hq, d, dtype=torch.float32, device=q.device)
        acc_lse = torch.full((hq, qn), float("-inf"), dtype=torch.float32, device=q.device)
        for ki, kn, ko, ks in k_runs:
            if ko > q_last:  # every key of the run is in these queries' future
                continue
            o, s = tri.attention_fwd(
                q[qi : qi + qn],
                k[ki : ki + kn],
                v[ki : ki + kn],
                q_offset=qo,
                q_stride=qs,
                k_offset=ko,
                k_stride=ks,
                softmax_scale=softmax_scale,
            )
            acc_out, acc_lse = merge_attn_states(acc_out, acc_lse, o.float(), s)
        out[qi : qi + qn] = acc_out.to(q.dtype)
        lse[:, qi : qi + qn] = acc_lse
    return out, lse
