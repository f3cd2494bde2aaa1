"""Ring attention: exact causal attention over a sequence-parallel group by rotating KV shards.

Each of the `sp` ranks holds its shard of the chunk's queries and keys/values (any layout; the absolute
positions passed in decide causality) and optionally a `history` KV it kept from earlier chunks. The rank's
*block* is its chunk KV plus its history KV. In step `s` (0..sp-1) a rank attends its queries to the block
that originated on rank `(rank - s) % sp`, while the block is forwarded to `rank + 1` and the next one is
received from `rank - 1`: one `batch_isend_irecv` per step holding exactly one send and one receive on every
rank (symmetric, so NCCL's grouped P2P cannot hang), posted before the local compute so they overlap.
Partial results are merged in fp32 with `merge_attn_states`.

Shards may differ in length per rank. Lengths (and each block's position range) are exchanged once with a
small `all_gather` before the first step, so every receive buffer is sized exactly; an empty block is sent
as a 1-token dummy so every rank still posts a real send and receive. Each block travels as one byte buffer
`[positions int64 | k,v]`. On NCCL the caller must have called `torch.cuda.set_device` (as for any
`batch_isend_irecv`); the metadata `all_gather` is always the group's first collective of a call.

Volume: step `s` moves the block from rank `(rank - s) % sp` one hop, `n_src * (2 * Hkv * D * elem + 8)`
bytes; over `sp - 1` steps each rank sends every other rank's block once, i.e. `(sp - 1) / sp` of the
group's total KV (chunk + history). `CommStats` records the bytes per step and the payload (theory).

History rotates with the ring: history KV held on rank r is part of r's block, so queries on every rank
see all history without any extra step. A `retain` callback sees every block as it passes through (all
`sp` blocks visit every rank), so a rank can keep the token ranges a plan assigns to it (LoongServe's
proactive scale-down) and no KV needs to move after prefill; see `KVRetention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..merge import merge_attn_states
from . import p2p
from .comm import (
    CommStats,
    Group,
    Timer,
    all_gather_ints,
    global_rank,
    group_rank_size,
    p2p_args,
    pack,
    unpack,
    wait,
)
from .local import local_attention

# Called with (k [n, Hkv, D], v [n, Hkv, D], positions int64 [n]) for every block that visits this rank.
RetainFn = Callable[[Tensor, Tensor, Tensor], None]
History = tuple[Tensor, Tensor, Tensor]


class KVRetention:
    """Keeps the KV of the given absolute positions from the blocks that pass through a rank.

    Pass it as `retain=` to `ring_attention`; afterwards `result()` returns `(k, v, positions)` sorted by
    position. Calling it on several ring calls (e.g. every layer) needs one instance per call.
    """

    def __init__(self, positions: Tensor) -> None:
        if positions.dim() != 1:
            raise ValueError(f"retain positions must be 1-D, got shape {tuple(positions.shape)}")
        self.wanted = torch.unique(positions.to(torch.int64))  # sorted
        self._parts: list[tuple[Tensor, Tensor, Tensor]] = []
        self._like: tuple[Tensor, Tensor] | None = None

    def __call__(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        if self._like is None:
            self._like = (k[:0], v[:0])
        keep = torch.isin(pos, self.wanted.to(pos.device))
        if bool(keep.any()):
            self._parts.append((k[keep].clone(), v[keep].clone(), pos[keep].clone()))

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        """`(k [n, Hkv, D], v [n, Hkv, D], positions [n])` sorted by position; ValueError if any is missing."""
        if self._like is None:
            raise ValueError("no block has passed through this retention yet")
        if not self._parts:
            k, v, pos = self._like[0], self._like[1], self.wanted.new_empty(0)
        else:
            k = torch.cat([p[0] for p in self._parts])
            v = torch.cat([p[1] for p in self._parts])
            pos = torch.cat([p[2] for p in self._parts])
        order = torch.argsort(pos)
        k, v, pos = k[order], v[order], pos[order]
        if not torch.equal(pos.cpu(), self.wanted):
            missing = self.wanted[~torch.isin(self.wanted, pos.cpu())]
            raise ValueError(f"retention missing {missing.numel()} positions (first: {missing[:8].tolist()})")
        return k, v, pos


def check_inputs(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor) -> None:
    """Local validation shared by the distributed functions; raises ValueError before any communication."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim differs: q {q.shape[2]} vs k {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, pos, t in (("q_positions", q_positions, q), ("k_positions", k_positions, k)):
        if pos.dim() != 1 or pos.shape[0] != t.shape[0]:
            raise ValueError(f"{name} must be 1-D with {t.shape[0]} entries, got shape {tuple(pos.shape)}")
        if pos.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer tensor, got {pos.dtype}")


def _check_history(history: History, k: Tensor) -> None:
    kh, vh, ph = history
    if kh.dim() != 3 or kh.shape != vh.shape or kh.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"history k/v must be [n, {k.shape[1]}, {k.shape[2]}], got {tuple(kh.shape)}, {tuple(vh.shape)}"
        )
    if kh.dtype != k.dtype or vh.dtype != k.dtype:
        raise ValueError(f"history dtype {kh.dtype} differs from k dtype {k.dtype}")
    if ph.dim() != 1 or ph.shape[0] != kh.shape[0] or ph.dtype.is_floating_point:
        raise ValueError(f"history positions must be integer [{kh.shape[0]}], got {ph.dtype} {tuple(ph.shape)}")


def _specs(n: int, hkv: int, d: int, dtype: torch.dtype) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(torch.int64, (n,)), (dtype, (n, 2, hkv, d))]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group = None,
    *,
    q_positions: Tensor,
    k_positions: Tensor,
    history: History | None = None,
    retain: RetainFn | None = None,
    softmax_scale: float | None = None,
    stats: CommStats | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of this rank's queries to the whole group's KV (chunk shards + history).

    q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]` (this rank's shard), positions int `[Tq]` / `[Tk]` (absolute);
    `history` = (k_hist `[Th, Hkv, D]`, v_hist, positions `[Th]`) held by this rank. Every rank of `group`
    must call this collectively. Returns `out [Tq, Hq, D]` (q's dtype) and `lse [Hq, Tq]` fp32, equal to
    `attention_fwd` over the union of all ranks' KV.
    """
    check_inputs(q, k, v, q_positions, k_positions)
    if history is not None:
        _check_history(history, k)
    rank, sp = group_rank_size(group)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    dev = q.device
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    k_pos = k_positions.to(device=dev, dtype=torch.int64)
    if history is not None:
        kh, vh, ph = history
        k_all, v_all = torch.cat([k, kh]), torch.cat([v, vh])
        k_pos = torch.cat([k_pos, ph.to(device=dev, dtype=torch.int64)])
    else:
        k_all, v_all = k, v
    n_own = k_all.shape[0]
    pmin = int(k_pos.min()) if n_own else 0
    pmax = int(k_pos.max()) if n_own else -1
    meta = all_gather_ints([n_own, hkv, d, q.element_size(), pmin, pmax], group, dev, stats)
    if any(m[1:4] != [hkv, d, q.element_size()] for m in meta):
        raise ValueError(f"ranks disagree on (kv heads, head_dim, element size): {[m[1:4] for m in meta]}")
    q_pos = q_positions.to(device=dev, dtype=torch.int64)
    q_max = int(q_pos.max()) if tq else -1

    own = pack([k_pos, torch.stack([k_all, v_all], dim=1)])  # [n*8 + n*2*Hkv*D*elem] bytes
    block_bytes = 8 + 2 * hkv * d * q.element_size()  # per token: position + k + v
    out_acc = torch.zeros(tq, hq, d, dtype=torch.float32, device=dev)  # [Tq, Hq, D]
    lse_acc = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=dev)  # [Hq, Tq]
    nxt, prv = global_rank(group, (rank + 1) % sp), global_rank(group, (rank - 1) % sp)
    cur, src = own, rank
    for step in range(sp):
        n_cur = meta[src][0]
        reqs, recv = [], None
        if step < sp - 1:
            nsrc = (src - 1) % sp  # the block rank-1 holds now
            n_next = meta[nsrc][0]
            send = cur if n_cur else torch.zeros(block_bytes, dtype=torch.uint8, device=dev)
            recv = torch.empty(max(n_next, 1) * block_bytes, dtype=torch.uint8, device=dev)
            pg, tag = p2p_args(group)
            ops = [p2p.Op(p2p.isend, send, nxt, pg, tag), p2p.Op(p2p.irecv, recv, prv, pg, tag)]
            reqs = p2p.batch_isend_irecv(ops)
            if stats is not None:
                stats.record(send.numel(), recv.numel(), n_cur * block_bytes)
        with Timer(stats, "compute_s"):
            pos_b, kv_b = unpack(cur, _specs(n_cur, hkv, d, q.dtype))
            k_b, v_b = kv_b[:, 0], kv_b[:, 1]  # [n, Hkv, D]
            if retain is not None:
                retain(k_b, v_b, pos_b)
            if n_cur and tq and meta[src][4] <= q_max:  # skip blocks entirely in every query's future
                o, lse = local_attention(q, k_b, v_b, q_positions=q_pos, k_positions=pos_b, softmax_scale=scale)
                out_acc, lse_acc = merge_attn_states(out_acc, lse_acc, o.float(), lse)
        with Timer(stats, "wait_s"):
            for r in reqs:
                wait(r)
        if recv is not None:
            cur, src = recv, nsrc
    return out_acc.to(q.dtype), lse_acc
