import pytest
import torch

from spindle_attention import attention_fwd, merge_attn_states, merge_attn_states_many, positions
from spindle_attention.testing import naive_attention


def _qkv(tq: int, tk: int, hq: int, hkv: int, d: int = 16, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tq, hq, d, generator=g, dtype=dtype),
        torch.randn(tk, hkv, d, generator=g, dtype=dtype),
        torch.randn(tk, hkv, d, generator=g, dtype=dtype),
    )


def _assert_close(out, lse, ref_out, ref_lse, atol=2e-5):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=1e-4)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("tq,history", [(1, 0), (59, 0), (339, 0), (59, 280), (1, 338), (7, 5)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4)])
def test_chunk_over_history_matches_naive(tq, history, hq, hkv):
    q, k, v = _qkv(tq, history + tq, hq, hkv)
    out, lse = attention_fwd(q, k, v, q_offset=history, block_q=64, block_k=48)
    ref_out, ref_lse = naive_attention(q, k, v, positions(history, tq), positions(0, history + tq))
    _assert_close(out, lse, ref_out, ref_lse)


def test_no_lse_path_matches():
    q, k, v = _qkv(339, 339, 9, 3)
    out, lse = attention_fwd(q, k, v, return_lse=False)
    assert lse is None
    ref_out, _ = naive_attention(q, k, v, positions(0, 339), positions(0, 339))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    # with history the no-LSE call takes the tiled path and must agree too
    out2, _ = attention_fwd(q[-59:], k, v, q_offset=280, return_lse=False)
    torch.testing.assert_close(out2.double(), ref_out[-59:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("world,rank_q,rank_k", [(3, 0, 2), (3, 2, 0), (4, 1, 1)])
def test_striped_shards(world, rank_q, rank_k):
    # a striped shard (tokens rank, rank+world, ...) attending to another rank's striped keys
    tq, tk = 40, 39
    q, k, v = _qkv(tq, tk, 9, 3, seed=world + rank_q)
    out, lse = attention_fwd(
        q, k, v, q_offset=rank_q, q_stride=world, k_offset=rank_k, k_stride=world, block_q=16, block_k=16
    )
    ref = naive_attention(q, k, v, positions(rank_q, tq, world), positions(rank_k, tk, world))
    _assert_close(out, lse, *ref)


def test_fully_masked_rows_are_empty():
    # queries at positions 0..4 over keys at positions 10..19: nothing visible
    q, k, v = _qkv(5, 10, 9, 3)
    out, lse = attention_fwd(q, k, v, q_offset=0, k_offset=10)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    # partially masked: first query sees nothing, later ones see some keys
    out, lse = attention_fwd(q, k, v, q_offset=9, k_offset=10, block_k=4)
    ref = naive_attention(q, k, v, positions(9, 5), positions(10, 10))
    _assert_close(out, lse, *ref)
    assert torch.isneginf(lse[:, 0]).all() and torch.all(out[0] == 0)


def test_empty_history_and_empty_inputs():
    q, k, v = _qkv(0, 0, 9, 3)
    out, lse = attention_fwd(q, k, v)
    assert out.shape == (0, 9, 16) and lse.shape == (9, 0)
    q, _, _ = _qkv(3, 0, 9, 3)
    out, lse = attention_fwd(q, k, v)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_varlen_batch_with_per_sequence_offsets():
    lens_q, hist = [5, 59, 1], [0, 40, 17]
    lens_k = [a + b for a, b in zip(lens_q, hist, strict=True)]
    q, _, _ = _qkv(sum(lens_q), 0, 9, 3, seed=3)
    _, k, v = _qkv(0, sum(lens_k), 9, 3, seed=4)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()])
    out, lse = attention_fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_offset=torch.tensor(hist), block_q=8, block_k=8
    )
    for i in range(3):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ref = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke], positions(hist[i], lens_q[i]), positions(0, lens_k[i]))
        _assert_close(out[qs:qe], lse[:, qs:qe], *ref)


def test_non_causal_and_fp16():
    q, k, v = _qkv(33, 21, 8, 2, dtype=torch.float16)
    out, lse = attention_fwd(q, k, v, causal=False)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    ref = naive_attention(q, k, v, positions(0, 33), positions(0, 21), causal=False)
    torch.testing.assert_close(out.double(), ref[0], atol=2e-3, rtol=2e-3)


def test_merge_equals_attention_over_union():
    q, k, v = _qkv(37, 90, 9, 3)
    full = naive_attention(q, k, v, positions(53, 37), positions(0, 90))
    a = attention_fwd(q, k[:50], v[:50], q_offset=53)
    b = attention_fwd(q, k[50:], v[50:], q_offset=53, k_offset=50)
    _assert_close(*merge_attn_states(*a, *b), *full)
    parts = [attention_fwd(q, k[s : s + 30], v[s : s + 30], q_offset=53, k_offset=s) for s in (0, 30, 60)]
    _assert_close(*merge_attn_states_many([p[0] for p in parts], [p[1] for p in parts]), *full)


def test_merge_of_empty_states_stays_empty():
    out = torch.zeros(4, 3, 8)
    lse = torch.full((3, 4), float("-inf"))
    o, lse_m = merge_attn_states(out, lse, out, lse)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse_m))
    o, lse_m = merge_attn_states_many(torch.stack([out] * 3), torch.stack([lse] * 3))
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse_m))
    # empty merged with non-empty gives the non-empty state back
    x = torch.randn(4, 3, 8)
    lx = torch.randn(3, 4)
    o, lse_m = merge_attn_states(x, lx, out, lse)
    torch.testing.assert_close(o, x)
    torch.testing.assert_close(lse_m, lx)


def test_bad_shapes_raise_value_error():
    q, k, v = _qkv(4, 4, 9, 2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention_fwd(q, k, v)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_fwd(*_qkv(4, 4, 9, 3), cu_seqlens_q=torch.tensor([0, 4]))
