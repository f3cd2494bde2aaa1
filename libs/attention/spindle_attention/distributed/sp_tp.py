"""CSPS SP-TP: sequence-sharded activations, head-parallel (tensor-parallel) attention and projections.

Each rank holds a token shard `x [n_r, hidden]` (any layout; `positions` are absolute). One attention layer:
1. `all_gather_tokens`: every rank gets all tokens `[N, hidden]` (shards concatenated in rank order) and
   their positions; each rank sends its shard to the `sp - 1` others: `(sp - 1) * n_r * (hidden * elem + 8)`
   bytes.
2. Head-parallel attention: rank p projects only its query heads (and the KV heads they use, see
   `ulysses.head_split`; a KV head shared by two ranks is computed on both) with its rows of `w_q/w_k/w_v`,
   applies `rope`, attends causally over all N tokens (plus its heads of the `history` KV), and applies its
   column slice of `w_o`, giving a partial sum `[N, hidden]`.
3. `reduce_scatter_tokens`: partial sums are summed (fp32) and each rank keeps its own tokens: each rank
   sends `(N - n_r) * hidden * elem` bytes.
Both collectives are `all_to_all`s with per-rank split sizes (uneven shards; `token_collectives`); with
`gpus_per_node` they are hierarchical: across nodes, then within (all-gather), and the reverse (reduce-scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .comm import CommStats, Group, Timer, group_rank_size
from .token_collectives import all_gather_tokens_hierarchical, reduce_scatter_tokens_hierarchical
from .ulysses import _attend_heads, head_split

# (q [N, hq, D], k [N, hk, D], positions [N]) -> rotated (q, k)
RopeFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def sp_tp_attention(
    x: Tensor,
    group: Group = None,
    *,
    positions: Tensor,
    w_q: Tensor,
    w_k: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    rope: RopeFn | None = None,
    history: tuple[Tensor, Tensor, Tensor] | None = None,
    softmax_scale: float | None = None,
    stats: CommStats | None = None,
    gpus_per_node: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One SP-TP attention layer. x `[n_r, hidden]`; weights in `nn.Linear` layout (full matrices; each rank
    reads only its heads' rows/columns): w_q `[Hq*D, hidden]`, w_k/w_v `[Hkv*D, hidden]`, w_o
    `[hidden, Hq*D]`. `history` = this rank's KV heads (`head_split`) over all earlier tokens:
    (k `[Th, hk_r, D]`, v, positions `[Th]`).

    Returns `(y [n_r, hidden]` for this rank's tokens, and this rank's new KV heads `k, v [N, hk_r, D]`
    over all N chunk tokens in gathered order) — the head-sharded KV a TP cache keeps. `gpus_per_node`: the
    group's members packed that many to a node, collectives hierarchical (None: flat).
    """
    if x.dim() != 2 or w_q.shape[1] != x.shape[1] or w_k.shape != w_v.shape or w_o.shape[0] != x.shape[1]:
        raise ValueError(
            f"bad shapes: x {tuple(x.shape)}, w_q {tuple(w_q.shape)}, w_k {tuple(w_k.shape)}, "
            f"w_v {tuple(w_v.shape)}, w_o {tuple(w_o.shape)}"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads or w_q.shape[0] % num_q_heads:
        raise ValueError(f"heads {num_q_heads}/{num_kv_heads} do not fit w_q rows {w_q.shape[0]}")
    d = w_q.shape[0] // num_q_heads
    if w_k.shape[0] != num_kv_heads * d or w_o.shape[1] != num_q_heads * d:
        raise ValueError(f"w_k rows {w_k.shape[0]} / w_o cols {w_o.shape[1]} do not match heads and head_dim {d}")
    rank, sp = group_rank_size(group)
    (qs, qe), (ks, ke) = head_split(num_q_heads, num_kv_heads, sp)[rank]
    if history is not None and (history[0].dim() != 3 or history[0].shape[1:] != (ke - ks, d)):
        raise ValueError(f"history must hold this rank's {ke - ks} KV heads of dim {d}, got {tuple(history[0].shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    x_all, pos, lengths = all_gather_tokens_hierarchical(x, positions, group, gpus_per_node, stats)  # [N, hidden]
    n = x_all.shape[0]
    with Timer(stats, "compute_s"):
        q = (x_all @ w_q[qs * d : qe * d].T).view(n, qe - qs, d)  # [N, hq_r, D]
        k = (x_all @ w_k[ks * d : ke * d].T).view(n, ke - ks, d)  # [N, hk_r, D]
        v = (x_all @ w_v[ks * d : ke * d].T).view(n, ke - ks, d)
        if rope is not None and qe > qs:
            q, k = rope(q, k, pos)
        k_att, v_att, kpos = k, v, pos
        if history is not None:
            k_att, v_att = torch.cat([k, history[0]]), torch.cat([v, history[1]])
            kpos = torch.cat([pos, history[2].to(pos)])
        if qe > qs:
            out, _ = _attend_heads(q, k_att, v_att, pos, kpos, (qs, qe), ks, num_q_heads // num_kv_heads, scale)
            partial = out.reshape(n, (qe - qs) * d) @ w_o[:, qs * d : qe * d].T  # [N, hidden]
        else:
            partial = x_all.new_zeros(n, w_o.shape[0])
    y = reduce_scatter_tokens_hierarchical(partial, lengths, group, gpus_per_node, stats)
    return y, k, v
