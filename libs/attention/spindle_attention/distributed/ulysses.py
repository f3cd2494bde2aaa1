"""Ulysses (all-to-all) sequence parallelism: sequence-sharded -> head-sharded -> local attention -> back.

Each rank holds a token shard of q `[Tq_r, Hq, D]` and k/v `[Tk_r, Hkv, D]` (uneven shards and any layout
allowed; absolute positions decide causality, and a rank's `history` KV simply joins its k/v shard). Query
heads are split into `sp` contiguous runs whose sizes differ by at most one (`head_split`), so the group
size need not divide the head count (SmolLM2: 9 query / 3 KV heads on sp = 2 or 4; with sp > Hq some ranks
get no heads and only relay). A rank receives the KV heads its query heads use; a KV head shared by two
ranks' query runs is replicated to both (no padding, no failure).

Communication, one `all_to_all_single` with per-rank byte split sizes each way (gloo supports it on CPU,
NCCL on GPU; the list form `all_to_all` with unequal sizes does not work on gloo):
1. forward: rank r sends rank p `[q_pos | k_pos | q[:, heads_p] | k[:, kv_heads_p] | v[:, kv_heads_p]]`,
   about `Tq_r * Hq_p * D + 2 * Tk_r * Hkv_p * D` elements + 8 bytes per position;
2. backward: rank p returns rank r `[lse[heads_p, tokens_r] fp32 | out[tokens_r, heads_p]]`.
Each rank sends roughly `(sp - 1) / sp` of its q, k, v and out (KV more when heads are replicated).
`CommStats` records both phases' bytes (excluding the part a rank keeps for itself).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .comm import CommStats, Group, Timer, all_gather_ints, all_to_all_bytes, group_rank_size, pack, unpack
from .layouts import _runs
from .local import local_attention
from .ring import History, _check_history, check_inputs


def head_split(num_q_heads: int, num_kv_heads: int, sp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank: (query head run [qs, qe), KV head run [ks, ke)) it computes; empty runs are (0, 0)."""
    group = num_q_heads // num_kv_heads
    out = []
    for qs, qe in _runs(num_q_heads, sp):
        out.append(((qs, qe), (qs // group, (qe - 1) // group + 1)) if qe > qs else ((0, 0), (0, 0)))
    return out


def _attend_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    q_run: tuple[int, int],
    kv_lo: int,
    group: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Local attention for query heads `q_run` whose KV heads start at global KV head `kv_lo`."""
    qs, qe = q_run
    nq, nk = qe - qs, k.shape[1]
    aligned = qs % group == 0 and nq % group == 0 and nq // group == nk
    if not aligned:  # a partial group: give every query head its own copy of its KV head (local only)
        idx = torch.tensor([h // group - kv_lo for h in range(qs, qe)], device=k.device)
        k, v = k.index_select(1, idx), v.index_select(1, idx)
    return local_attention(q, k, v, q_positions=q_pos, k_positions=k_pos, softmax_scale=scale)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group = None,
    *,
    q_positions: Tensor,
    k_positions: Tensor,
    history: History | None = None,
    softmax_scale: float | None = None,
    stats: CommStats | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of this rank's query shard to every rank's KV via two all-to-alls.

    Same contract as `ring_attention`: returns `out [Tq, Hq, D]` (q's dtype) and `lse [Hq, Tq]` fp32 for this
    rank's query tokens, equal to `attention_fwd` over the union of all ranks' KV (chunk + history).
    """
    check_inputs(q, k, v, q_positions, k_positions)
    if history is not None:
        _check_history(history, k)
    rank, sp = group_rank_size(group)
    tq, hq, d = q.shape
    hkv, dev, dtype, elem = k.shape[1], q.device, q.dtype, q.element_size()
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q_pos = q_positions.to(device=dev, dtype=torch.int64)
    k_pos = k_positions.to(device=dev, dtype=torch.int64)
    if history is not None:
        k = torch.cat([k, history[0]])
        v = torch.cat([v, history[1]])
        k_pos = torch.cat([k_pos, history[2].to(device=dev, dtype=torch.int64)])
    tk = k.shape[0]
    meta = all_gather_ints([tq, tk, hq, hkv, d, elem], group, dev, stats)
    if any(m[2:] != [hq, hkv, d, elem] for m in meta):
        raise ValueError(f"ranks disagree on (q heads, kv heads, head_dim, element size): {[m[2:] for m in meta]}")
    runs = head_split(hq, hkv, sp)
    (my_qs, my_qe), (my_ks, my_ke) = runs[rank]
    nq_me, nk_me = my_qe - my_qs, my_ke - my_ks

    # 1. sequence-sharded -> head-sharded
    parts, send_sizes = [], []
    for (qs, qe), (ks, ke) in runs:
        buf = pack([q_pos, k_pos, q[:, qs:qe], k[:, ks:ke], v[:, ks:ke]])
        parts.append(buf)
        send_sizes.append(buf.numel())
    recv_sizes = [8 * (m[0] + m[1]) + elem * d * (m[0] * nq_me + 2 * m[1] * nk_me) for m in meta]
    send = torch.cat(parts)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    with Timer(stats, "wait_s"):
        all_to_all_bytes(recv, send, recv_sizes, send_sizes, group)
    if stats is not None:
        remote = sum(send_sizes) - send_sizes[rank]
        stats.record(remote, sum(recv_sizes) - recv_sizes[rank], remote)

    qp, kp, qf, kf, vf = [], [], [], [], []
    for m, chunk in zip(meta, torch.split(recv, recv_sizes), strict=True):
        a, b, c, e, f = unpack(
            chunk,
            [
                (torch.int64, (m[0],)),
                (torch.int64, (m[1],)),
                (dtype, (m[0], nq_me, d)),
                (dtype, (m[1], nk_me, d)),
                (dtype, (m[1], nk_me, d)),
            ],
        )
        qp.append(a), kp.append(b), qf.append(c), kf.append(e), vf.append(f)
    q_all = torch.cat(qf)  # [sum Tq_r, nq_me, D]
    with Timer(stats, "compute_s"):
        if nq_me:
            out_h, lse_h = _attend_heads(
                q_all, torch.cat(kf), torch.cat(vf), torch.cat(qp), torch.cat(kp), (my_qs, my_qe), my_ks, g, scale
            )
        else:
            out_h = q_all  # [T, 0, D]
            lse_h = torch.empty(0, q_all.shape[0], dtype=torch.float32, device=dev)

    # 2. head-sharded -> sequence-sharded
    bounds = [0]
    for m in meta:
        bounds.append(bounds[-1] + m[0])
    back_send = [(lse_h[:, bounds[r] : bounds[r + 1]], out_h[bounds[r] : bounds[r + 1]]) for r in range(sp)]
    send_sizes = [4 * lse.numel() + elem * o.numel() for lse, o in back_send]
    heads = [qe - qs for (qs, qe), _ in runs]
    recv_sizes = [(4 + elem * d) * tq * n for n in heads]
    send = torch.cat([pack(list(p)) for p in back_send])
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    with Timer(stats, "wait_s"):
        all_to_all_bytes(recv, send, recv_sizes, send_sizes, group)
    if stats is not None:
        remote = sum(send_sizes) - send_sizes[rank]
        stats.record(remote, sum(recv_sizes) - recv_sizes[rank], remote)
    outs, lses = [], []
    for n, chunk in zip(heads, torch.split(recv, recv_sizes), strict=True):
        lse_c, out_c = unpack(chunk, [(torch.float32, (n, tq)), (dtype, (tq, n, d))])
        lses.append(lse_c), outs.append(out_c)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0)
