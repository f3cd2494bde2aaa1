"""Ulysses (all-to-all) attention on real gloo groups of 1-4 processes vs `attention_fwd` unsharded."""

import pytest

from spindle_attention import attention_fwd
from spindle_attention.distributed import LAYOUTS, CommStats, head_split, shard_indices, ulysses_attention
from spindle_attention.distributed.testing import run_group

from .test_distributed_ring import TOKENS, _close, _history_case, _qkv


def _ulysses_worker(rank: int, ws: int) -> None:
    for hq, hkv, tokens in ((9, 3, TOKENS), (2, 1, (7, 30)), (4, 4, (13,))):
        for n in tokens:
            q, k, v = _qkv(n, seed=n, hq=hq, hkv=hkv)
            ref_out, ref_lse = attention_fwd(q, k, v)
            for layout in LAYOUTS:
                idx = shard_indices(n, ws, layout)[rank]
                stats = CommStats()
                out, lse = ulysses_attention(q[idx], k[idx], v[idx], q_positions=idx, k_positions=idx, stats=stats)
                _close(out, lse, ref_out[idx], ref_lse[:, idx])
                assert len(stats.step_bytes_sent) == 2
    _history_case(rank, ws, ulysses_attention, ws, "zigzag", seed=1)
    _history_case(rank, ws, ulysses_attention, max(1, ws // 2), "stripe", seed=2)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_ulysses_attention_matches_unsharded(ws):
    run_group(_ulysses_worker, ws)


def test_head_split_covers_heads_and_their_kv():
    for hq, hkv in ((9, 3), (2, 1), (32, 8), (4, 4)):
        for sp in range(1, 7):
            runs = head_split(hq, hkv, sp)
            sizes = [qe - qs for (qs, qe), _ in runs]
            assert sum(sizes) == hq and max(sizes) - min(sizes) <= 1
            for (qs, qe), (ks, ke) in runs:
                assert {h // (hq // hkv) for h in range(qs, qe)} == set(range(ks, ke))
