"""Ring attention on real gloo groups of 1-4 processes vs `attention_fwd` on the unsharded sequence."""

import pytest
import torch

from spindle_attention import attention_fwd
from spindle_attention.distributed import (
    LAYOUTS,
    CommStats,
    KVRetention,
    RankGroup,
    ring_attention,
    shard_indices,
    ulysses_attention,
)
from spindle_attention.distributed.testing import run_group

HQ, HKV, D = 9, 3, 32
TOKENS = (1001, 277, 7)


def _qkv(n: int, seed: int = 0, hq: int = HQ, hkv: int = HKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, hq, D, generator=g),
        torch.randn(n, hkv, D, generator=g),
        torch.randn(n, hkv, D, generator=g),
    )


def _close(out, lse, ref_out, ref_lse) -> None:
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _history_case(rank: int, ws: int, fn, old: int, layout: str, seed: int) -> None:
    """Chunk 2 [300, 577) on all `ws` ranks attends chunk-1 KV [0, 300) held contiguously by ranks < `old`."""
    start, total = 300, 577
    q, k, v = _qkv(total, seed)
    ref_out, ref_lse = attention_fwd(q[start:], k, v, q_offset=start)
    hist = shard_indices(start, old, "contiguous")[rank] if rank < old else torch.empty(0, dtype=torch.int64)
    idx = shard_indices(total - start, ws, layout)[rank]
    pos = idx + start
    keep = shard_indices(total, ws, "contiguous")[rank]  # the plan's home for each token after prefill
    kwargs = {"retain": KVRetention(keep)} if fn is ring_attention else {}
    out, lse = fn(q[pos], k[pos], v[pos], q_positions=pos, k_positions=pos, history=(k[hist], v[hist], hist), **kwargs)
    _close(out, lse, ref_out[idx], ref_lse[:, idx])
    if kwargs:
        rk, rv, rpos = kwargs["retain"].result()
        assert torch.equal(rpos, keep) and torch.equal(rk, k[keep]) and torch.equal(rv, v[keep])


def _ring_worker(rank: int, ws: int) -> None:
    block_bytes = 8 + 2 * HKV * D * 4
    for n in TOKENS:
        q, k, v = _qkv(n, seed=n)
        ref_out, ref_lse = attention_fwd(q, k, v)
        for layout in LAYOUTS:
            shards = shard_indices(n, ws, layout)
            idx = shards[rank]
            stats = CommStats()
            out, lse = ring_attention(q[idx], k[idx], v[idx], q_positions=idx, k_positions=idx, stats=stats)
            _close(out, lse, ref_out[idx], ref_lse[:, idx])
            # step s forwards the block that started on rank - s: exactly its tokens' bytes (theory)
            assert stats.step_payload_bytes == [len(shards[(rank - s) % ws]) * block_bytes for s in range(ws - 1)]
    for layout in LAYOUTS:
        _history_case(rank, ws, ring_attention, ws, layout, seed=1)
    _history_case(rank, ws, ring_attention, max(1, ws // 2), "stripe", seed=2)  # grown group, e.g. 2 -> 4
    if ws == 4:  # a subgroup of the world (like prefill ranks 1..N beside the kvstore's rank 0)
        sub = torch.distributed.new_group([1, 2, 3])
        if rank > 0:
            q, k, v = _qkv(277, seed=3)
            ref_out, ref_lse = attention_fwd(q, k, v)
            idx = shard_indices(277, 3, "zigzag")[rank - 1]
            for fn in (ring_attention, ulysses_attention):
                out, lse = fn(q[idx], k[idx], v[idx], sub, q_positions=idx, k_positions=idx)
                _close(out, lse, ref_out[idx], ref_lse[:, idx])
        # the same without new_group: a RankGroup in member order (3, 1) talks point-to-point; 0 and 2 idle
        if rank in (3, 1):
            member = (3, 1).index(rank)
            q, k, v = _qkv(101, seed=4)
            ref_out, ref_lse = attention_fwd(q, k, v)
            idx = shard_indices(101, 2, "stripe")[member]
            for fn in (ring_attention, ulysses_attention):
                out, lse = fn(q[idx], k[idx], v[idx], RankGroup((3, 1)), q_positions=idx, k_positions=idx)
                _close(out, lse, ref_out[idx], ref_lse[:, idx])
    if ws > 1:  # ranks disagreeing on head_dim all fail with ValueError after the metadata exchange
        d = D if rank == 0 else D // 2
        x = torch.zeros(3, HKV, d)
        with pytest.raises(ValueError, match="disagree"):
            ring_attention(x, x, x, q_positions=torch.arange(3), k_positions=torch.arange(3))


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_ring_attention_matches_unsharded(ws):
    run_group(_ring_worker, ws)


def test_bad_input_raises_before_communication():
    # no process group exists here: reaching any communication would raise RuntimeError instead
    q, k = torch.zeros(5, HQ, D), torch.zeros(5, HKV, D)
    pos = torch.arange(5)
    for fn in (ring_attention, ulysses_attention):
        with pytest.raises(ValueError, match="head_dim"):
            fn(q, torch.zeros(5, HKV, D + 1), torch.zeros(5, HKV, D + 1), q_positions=pos, k_positions=pos)
        with pytest.raises(ValueError, match="q_positions"):
            fn(q, k, k, q_positions=torch.arange(4), k_positions=pos)
        with pytest.raises(ValueError, match="k_positions"):
            fn(q, k, k, q_positions=pos, k_positions=torch.arange(6))
        with pytest.raises(ValueError, match="history"):
            fn(q, k, k, q_positions=pos, k_positions=pos, history=(k[:, :1], k[:, :1], torch.arange(5)))
