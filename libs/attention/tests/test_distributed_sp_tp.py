"""CSPS SP-TP attention layer on real gloo groups vs the same layer computed unsharded."""

import pytest
import torch

from spindle_attention import attention_fwd
from spindle_attention.distributed import (
    LAYOUTS,
    CommStats,
    RankGroup,
    all_gather_tokens,
    all_gather_tokens_hierarchical,
    head_split,
    reduce_scatter_tokens,
    reduce_scatter_tokens_hierarchical,
    shard_indices,
    sp_tp_attention,
)
from spindle_attention.distributed.testing import run_group
from spindle_attention.distributed.token_collectives import node_layout

HQ, HKV, D = 9, 3, 16
HIDDEN = 48


def _rope(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A position-dependent rotation (half-split RoPE) so that token order matters."""
    half = D // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos.float()[:, None] * freq[None, :]  # [N, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    return rot(q), rot(k)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w_q": torch.randn(HQ * D, HIDDEN, generator=g) * 0.1,
        "w_k": torch.randn(HKV * D, HIDDEN, generator=g) * 0.1,
        "w_v": torch.randn(HKV * D, HIDDEN, generator=g) * 0.1,
        "w_o": torch.randn(HIDDEN, HQ * D, generator=g) * 0.1,
    }


def _reference(x: torch.Tensor, w: dict[str, torch.Tensor], start: int) -> tuple[torch.Tensor, ...]:
    n = x.shape[0]
    pos = torch.arange(n)
    q = (x @ w["w_q"].T).view(n, HQ, D)
    k = (x @ w["w_k"].T).view(n, HKV, D)
    v = (x @ w["w_v"].T).view(n, HKV, D)
    q, k = _rope(q, k, pos)
    out, _ = attention_fwd(q[start:], k, v, q_offset=start)
    return out.reshape(n - start, HQ * D) @ w["w_o"].T, k, v


def _worker(rank: int, ws: int) -> None:
    w = _weights(0)
    (_, _), (ks, ke) = head_split(HQ, HKV, ws)[rank]
    for n, start in ((277, 0), (7, 0), (401, 150)):
        x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n))
        ref_y, ref_k, ref_v = _reference(x, w, start)
        hist = None
        if start:  # chunk 2: this rank's KV heads of the first `start` tokens (a TP cache)
            hp = torch.arange(start)
            hist = (ref_k[:start, ks:ke], ref_v[:start, ks:ke], hp)
        for layout in LAYOUTS:
            idx = shard_indices(n - start, ws, layout)[rank]
            stats = CommStats()
            y, k, v = sp_tp_attention(
                x[start:][idx],
                positions=idx + start,
                **w,
                num_q_heads=HQ,
                num_kv_heads=HKV,
                rope=_rope,
                history=hist,
                stats=stats,
            )
            torch.testing.assert_close(y, ref_y[idx], atol=1e-5, rtol=1e-5)
            order = torch.cat(shard_indices(n - start, ws, layout)) + start  # gathered token order
            torch.testing.assert_close(k, ref_k[order][:, ks:ke], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, ref_v[order][:, ks:ke], atol=1e-5, rtol=1e-5)
            assert len(stats.step_bytes_sent) == 2


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_sp_tp_attention_matches_unsharded(ws):
    run_group(_worker, ws)


def _hierarchical_worker(rank: int, ws: int, gpn: int) -> None:
    """Members packed `gpn` to a node: the two-step collectives give the flat ones' results, the SP-TP layer the
    unsharded one's, and fewer bytes cross nodes (to members of another node) than the flat all-gather sends."""
    w = _weights(1)
    n = 203  # 51/51/51/50 over 4, uneven
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(7))
    idx = shard_indices(n, ws, "zigzag")[rank]
    flat_x, flat_p, flat_len = all_gather_tokens(x[idx], idx)
    stats = CommStats()
    hx, hp, hl = all_gather_tokens_hierarchical(x[idx], idx, None, gpn, stats)
    assert hl == flat_len and torch.equal(hx, flat_x) and torch.equal(hp, flat_p)
    if gpn < ws:  # (one node: the flat collective)
        assert set(stats.bytes_by_phase) == {"across", "within"}
        # the flat one sends its shard to every member of the other nodes; this, only to its column's
        shard = idx.numel() * (HIDDEN * 4 + 8)
        assert (ws // gpn - 1) * shard <= stats.bytes_by_phase["across"] <= (ws // gpn - 1) * shard + 64  # + meta
        assert stats.bytes_by_phase["across"] < (ws - gpn) * shard
    partial = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(rank))
    flat = reduce_scatter_tokens(partial, flat_len)
    torch.testing.assert_close(reduce_scatter_tokens_hierarchical(partial, flat_len, None, gpn), flat)
    ref_y, _, _ = _reference(x, w, 0)
    y, _, _ = sp_tp_attention(x[idx], positions=idx, **w, num_q_heads=HQ, num_kv_heads=HKV, rope=_rope,
                              gpus_per_node=gpn)  # fmt: skip
    torch.testing.assert_close(y, ref_y[idx], atol=1e-5, rtol=1e-5)
    # over a RankGroup of the world in another order (two "nodes" of 2), the same
    group = RankGroup(tuple(reversed(range(ws))))
    me = group.ranks.index(rank)
    gidx = shard_indices(n, ws, "stripe")[me]
    hx, _, _ = all_gather_tokens_hierarchical(x[gidx], gidx, group, gpn)
    torch.testing.assert_close(hx, x[torch.cat(shard_indices(n, ws, "stripe"))])


@pytest.mark.parametrize(("ws", "gpn"), [(4, 2), (4, 4)])
def test_hierarchical_collectives_equal_the_flat_ones(ws, gpn):
    run_group(_hierarchical_worker, ws, gpn)


def test_a_hierarchy_needs_whole_nodes():
    assert node_layout([10, 11, 12, 13], 12, 2) == ([10, 12], [12, 13])
    assert node_layout([3, 1, 2, 0, 5, 4], 4, 3) == ([2, 4], [0, 5, 4])  # member 5: local 2 of node 1
    assert node_layout([0, 1, 2], 2, 4) == ([2], [0, 1, 2])  # one node
    with pytest.raises(ValueError, match="whole nodes"):
        node_layout(list(range(6)), 0, 4)
    with pytest.raises(ValueError, match="not a member"):
        node_layout([0, 1], 5, 1)
