import pytest
import torch

from spindle_attention import paged_decode, paged_prefill, positions
from spindle_attention.testing import naive_attention


def _paged(seqs: list[torch.Tensor], block_size: int, num_blocks: int, seed: int = 0):
    """Scatter contiguous per-sequence KV [len, Hkv, D] into a shuffled block pool."""
    hkv, d = seqs[0].shape[1:]
    cache = torch.zeros(num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    max_blocks = max(-(-len(s) // block_size) for s in seqs)
    table = torch.zeros(len(seqs), max(max_blocks, 1), dtype=torch.int32)
    for i, s in enumerate(seqs):
        for j in range(-(-len(s) // block_size)):
            blk = perm.pop()
            table[i, j] = blk
            part = s[j * block_size : (j + 1) * block_size]
            cache[blk, : len(part)] = part
    return cache, table


@pytest.mark.parametrize("num_splits", [1, 2, 5, None])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2)])
def test_paged_decode_matches_naive(num_splits, hq, hkv):
    lens = [1, 59, 339, 16, 0]
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(n, hkv, 16, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, 16, generator=g) for n in lens]
    q = torch.randn(len(lens), hq, 16, generator=g)
    k_cache, table = _paged(ks, 16, 64, seed=2)
    v_cache, _ = _paged(vs, 16, 64, seed=2)
    out, lse = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens), num_splits=num_splits)
    fast, no_lse = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens), num_splits=num_splits, return_lse=False)
    assert no_lse is None and not torch.isnan(fast).any()
    torch.testing.assert_close(fast, out, atol=2e-5, rtol=1e-4)
    for b, n in enumerate(lens):
        ref_o, ref_l = naive_attention(q[b : b + 1], ks[b], vs[b], positions(max(n - 1, 0), 1), positions(0, n))
        torch.testing.assert_close(out[b : b + 1].double(), ref_o, atol=2e-5, rtol=1e-4)
        if n == 0:
            assert torch.isneginf(lse[:, b]).all() and torch.all(out[b] == 0)
        else:
            torch.testing.assert_close(lse[:, b : b + 1].double(), ref_l, atol=2e-5, rtol=1e-4)


def test_paged_prefill_matches_naive():
    hist, chunk = [0, 40, 330], [59, 7, 9]
    g = torch.Generator().manual_seed(5)
    totals = [h + c for h, c in zip(hist, chunk, strict=True)]
    ks = [torch.randn(n, 3, 16, generator=g) for n in totals]
    vs = [torch.randn(n, 3, 16, generator=g) for n in totals]
    q = torch.randn(sum(chunk), 9, 16, generator=g)
    k_cache, table = _paged(ks, 16, 64, seed=3)
    v_cache, _ = _paged(vs, 16, 64, seed=3)
    cu = torch.tensor([0, 59, 66, 75])
    out, lse = paged_prefill(q, k_cache, v_cache, table, torch.tensor(totals), cu, block_q=32, block_k=48)
    for b in range(3):
        ref = naive_attention(q[cu[b] : cu[b + 1]], ks[b], vs[b], positions(hist[b], chunk[b]), positions(0, totals[b]))
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), ref[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[:, cu[b] : cu[b + 1]].double(), ref[1], atol=2e-5, rtol=1e-4)


def test_paged_decode_rejects_overlong_seq():
    cache = torch.zeros(4, 16, 3, 16)
    with pytest.raises(ValueError, match="capacity"):
        paged_decode(torch.zeros(1, 9, 16), cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([40]))
