"""The Triton kernels against the naive oracle and the torch reference, on CPU under TRITON_INTERPRET=1.

The interpreter is slow, so shapes are small (head_dim 16 mostly) and tiles are set explicitly. With
TRITON_INTERPRET=0 in the environment and a GPU present, the same tests run compiled on CUDA.
"""

import os
import subprocess
import sys

# Must happen before triton is first imported in this process (triton jits its own library at import);
# spindle_attention.triton itself imports triton only when a kernel is first launched.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import spindle_attention as ref
from spindle_attention import positions
from spindle_attention import triton as tri
from spindle_attention.testing import naive_attention
from spindle_attention.triton._jit import interpreting

# interpreting() raises a RuntimeError saying what to do when something imported triton before the line above.
if not interpreting() and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is not 1 and there is no GPU to run the kernels", allow_module_level=True)

DEVICE = "cpu" if interpreting() else "cuda"


def _qkv(tq: int, tk: int, hq: int, hkv: int, d: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g).to(DEVICE, dtype)  # [Tq, Hq, D]
    k = torch.randn(tk, hkv, d, generator=g).to(DEVICE, dtype)  # [Tk, Hkv, D]
    v = torch.randn(tk, hkv, d, generator=g).to(DEVICE, dtype)
    return q, k, v


def _naive(q, k, v, q_pos, k_pos, **kwargs):
    return naive_attention(q.cpu(), k.cpu(), v.cpu(), q_pos, k_pos, **kwargs)


def _assert_close(out, lse, ref_out, ref_lse, atol=2e-5, rtol=1e-4):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref_out.cpu().double(), atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse.cpu())
    assert torch.equal(finite, torch.isfinite(lse.cpu()))
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse.cpu().double()[finite], atol=atol, rtol=rtol)


def test_available():
    assert tri.available()


def test_import_without_triton_fails_only_at_launch():
    code = (
        "import sys, torch\n"
        "sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import spindle_attention.triton as t\n"
        "assert not t.available()\n"
        "try:\n"
        "    t.attention_fwd(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16))\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no RuntimeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- attention_fwd -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tq,history,hq,hkv,block_q,block_k",
    [
        (1, 0, 9, 3, 16, 16),
        (59, 0, 9, 3, 32, 16),
        (339, 0, 8, 2, 128, 64),
        (339, 0, 9, 3, 64, 32),
        (59, 280, 8, 2, 64, 32),
        (1, 338, 9, 3, 16, 64),
        (7, 5, 4, 4, 16, 16),
    ],
)
def test_chunk_over_history_matches_naive(tq, history, hq, hkv, block_q, block_k):
    q, k, v = _qkv(tq, history + tq, hq, hkv, seed=tq + history)
    out, lse = tri.attention_fwd(q, k, v, q_offset=history, block_q=block_q, block_k=block_k)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (hq, tq)
    _assert_close(out, lse, *_naive(q, k, v, positions(history, tq), positions(0, history + tq)))


def test_matches_torch_reference():
    q, k, v = _qkv(59, 99, 9, 3, seed=11)
    out, lse = tri.attention_fwd(q, k, v, q_offset=40, block_q=32, block_k=32)
    ref_out, ref_lse = ref.attention_fwd(q, k, v, q_offset=40)
    _assert_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("causal", [True, False])
def test_fp16(causal):
    q, k, v = _qkv(59, 99, 8, 2, seed=12, dtype=torch.float16)
    out, lse = tri.attention_fwd(q, k, v, causal=causal, q_offset=40, block_q=64, block_k=32)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    ref = _naive(q, k, v, positions(40, 59), positions(0, 99), causal=causal)
    _assert_close(out, lse, *ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d", [64, 128])
def test_model_head_dims(d):
    q, k, v = _qkv(20, 50, 8, 2, d=d, seed=d)
    out, lse = tri.attention_fwd(q, k, v, q_offset=30, block_q=32, block_k=16)
    _assert_close(out, lse, *_naive(q, k, v, positions(30, 20), positions(0, 50)))


def test_non_causal_padded_head_dim_and_scale():
    # head_dim 24 runs in 32-wide tiles with the tail masked
    q, k, v = _qkv(33, 21, 9, 3, d=24, seed=13)
    out, lse = tri.attention_fwd(q, k, v, causal=False, softmax_scale=0.3, block_q=32, block_k=16)
    _assert_close(out, lse, *_naive(q, k, v, positions(0, 33), positions(0, 21), causal=False, scale=0.3))


@pytest.mark.parametrize("world,rank_q,rank_k", [(3, 0, 2), (3, 2, 0)])
def test_striped_shards(world, rank_q, rank_k):
    tq, tk = 40, 39
    q, k, v = _qkv(tq, tk, 9, 3, seed=world + rank_q)
    out, lse = tri.attention_fwd(
        q, k, v, q_offset=rank_q, q_stride=world, k_offset=rank_k, k_stride=world, block_q=32, block_k=16
    )
    _assert_close(out, lse, *_naive(q, k, v, positions(rank_q, tq, world), positions(rank_k, tk, world)))


def test_fully_masked_rows_are_empty():
    # queries at positions 0..4 over keys at positions 10..19: nothing visible
    q, k, v = _qkv(5, 10, 9, 3)
    out, lse = tri.attention_fwd(q, k, v, q_offset=0, k_offset=10, block_q=16, block_k=16)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    # partially masked: the first query sees nothing, later ones see some keys
    out, lse = tri.attention_fwd(q, k, v, q_offset=9, k_offset=10, block_q=16, block_k=16)
    _assert_close(out, lse, *_naive(q, k, v, positions(9, 5), positions(10, 10)))
    assert torch.isneginf(lse[:, 0]).all() and torch.all(out[0] == 0)


def test_empty_history_and_empty_inputs():
    q, k, v = _qkv(0, 0, 9, 3)
    out, lse = tri.attention_fwd(q, k, v)
    assert out.shape == (0, 9, 16) and lse.shape == (9, 0)
    q, _, _ = _qkv(3, 0, 9, 3)
    out, lse = tri.attention_fwd(q, k, v, block_q=16, block_k=16)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_varlen_with_empty_sequences_and_key_offsets():
    # sequence 1 has no queries, sequence 2 no keys; keys of sequence 0 start at position 3
    lens_q, lens_k, q_off, k_off = [6, 0, 4], [9, 5, 0], [5, 0, 2], [3, 0, 0]
    q, _, _ = _qkv(sum(lens_q), 0, 8, 2, seed=8)
    _, k, v = _qkv(0, sum(lens_k), 8, 2, seed=9)
    cu_q = torch.tensor([0, 6, 6, 10], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 14, 14], dtype=torch.int32, device=DEVICE)
    out, lse = tri.attention_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        q_offset=torch.tensor(q_off, device=DEVICE),
        k_offset=torch.tensor(k_off, device=DEVICE),
        block_q=16,
        block_k=16,
    )
    ref = _naive(q[:6], k[:9], v[:9], positions(5, 6), positions(3, 9))
    _assert_close(out[:6], lse[:, :6], *ref)
    assert torch.all(out[6:] == 0) and torch.isneginf(lse[:, 6:]).all()


def test_varlen_batch_with_per_sequence_offsets():
    lens_q, hist = [5, 59, 1], [0, 40, 17]
    lens_k = [a + b for a, b in zip(lens_q, hist, strict=True)]
    q, _, _ = _qkv(sum(lens_q), 0, 9, 3, seed=3)
    _, k, v = _qkv(0, sum(lens_k), 9, 3, seed=4)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out, lse = tri.attention_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        q_offset=torch.tensor(hist, device=DEVICE),
        block_q=32,
        block_k=16,
    )
    for i in range(3):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ref = _naive(q[qs:qe], k[ks:ke], v[ks:ke], positions(hist[i], lens_q[i]), positions(0, lens_k[i]))
        _assert_close(out[qs:qe], lse[:, qs:qe], *ref)


def test_no_lse_and_unsupported_arguments():
    q, k, v = _qkv(20, 20, 4, 2)
    out, lse = tri.attention_fwd(q, k, v, return_lse=False, block_q=32, block_k=16)
    assert lse is None
    ref_out, _ = _naive(q, k, v, positions(0, 20), positions(0, 20))
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-5, rtol=1e-4)
    with pytest.raises(NotImplementedError):
        tri.attention_fwd(q, k, v, q_positions=positions(0, 20))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tri.attention_fwd(*_qkv(4, 4, 9, 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        tri.attention_fwd(q, k, v, cu_seqlens_q=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="power of two"):
        tri.attention_fwd(q, k, v, block_q=24)
    with pytest.raises(ValueError, match="strides"):
        tri.attention_fwd(q, k, v, q_stride=0)


# --- paged ---------------------------------------------------------------------------------------------------


def _paged(seqs: list[torch.Tensor], block_size: int, num_blocks: int, seed: int = 0):
    """Scatter contiguous per-sequence KV [len, Hkv, D] into a shuffled block pool."""
    hkv, d = seqs[0].shape[1:]
    cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=seqs[0].dtype)  # [blocks, block_size, Hkv, D]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    max_blocks = max(-(-len(s) // block_size) for s in seqs)
    table = torch.zeros(len(seqs), max(max_blocks, 1), dtype=torch.int32)  # [B, max_blocks]
    for i, s in enumerate(seqs):
        for j in range(-(-len(s) // block_size)):
            blk = perm.pop()
            table[i, j] = blk
            part = s[j * block_size : (j + 1) * block_size]
            cache[blk, : len(part)] = part
    return cache.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize(
    "num_splits,hq,hkv,dtype,block_size",
    [
        (1, 9, 3, torch.float32, 16),
        (3, 9, 3, torch.float32, 16),
        (3, 8, 2, torch.float32, 12),
        (1, 8, 2, torch.float16, 16),
        (3, 8, 2, torch.float16, 16),
    ],
)
def test_paged_decode_matches_naive(num_splits, hq, hkv, dtype, block_size):
    lens = [1, 59, 339, 16, 0, 37]
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(n, hkv, 16, generator=g).to(dtype) for n in lens]
    vs = [torch.randn(n, hkv, 16, generator=g).to(dtype) for n in lens]
    q = torch.randn(len(lens), hq, 16, generator=g).to(DEVICE, dtype)  # [B, Hq, D]
    k_cache, table = _paged(ks, block_size, 64, seed=2)
    v_cache, _ = _paged(vs, block_size, 64, seed=2)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out, lse = tri.paged_decode(q, k_cache, v_cache, table, seq_lens, num_splits=num_splits, block_k=32)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, len(lens))
    atol = 2e-5 if dtype == torch.float32 else 2e-3
    for b, n in enumerate(lens):
        ref = _naive(q[b : b + 1], ks[b], vs[b], positions(max(n - 1, 0), 1), positions(0, n))
        _assert_close(out[b : b + 1], lse[:, b : b + 1], *ref, atol=atol, rtol=max(atol, 1e-4))
        if n == 0:
            assert torch.all(out[b] == 0) and torch.isneginf(lse[:, b]).all()


def test_paged_decode_rejects_bad_input():
    cache = torch.zeros(4, 16, 3, 16, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="capacity"):
        tri.paged_decode(torch.zeros(1, 9, 16, device=DEVICE), cache, cache, table, torch.tensor([40], device=DEVICE))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tri.paged_decode(torch.zeros(1, 8, 16, device=DEVICE), cache, cache, table, torch.tensor([4], device=DEVICE))


def test_paged_prefill_matches_naive():
    hist, chunk = [0, 40, 330], [59, 7, 9]
    g = torch.Generator().manual_seed(5)
    totals = [h + c for h, c in zip(hist, chunk, strict=True)]
    ks = [torch.randn(n, 3, 16, generator=g) for n in totals]
    vs = [torch.randn(n, 3, 16, generator=g) for n in totals]
    q = torch.randn(sum(chunk), 9, 16, generator=g).to(DEVICE)  # [Tq, Hq, D]
    k_cache, table = _paged(ks, 16, 64, seed=3)
    v_cache, _ = _paged(vs, 16, 64, seed=3)
    cu = torch.tensor([0, 59, 66, 75], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(totals, device=DEVICE)
    out, lse = tri.paged_prefill(q, k_cache, v_cache, table, seq_lens, cu, block_q=64, block_k=32)
    for b in range(3):
        ref = _naive(q[cu[b] : cu[b + 1]], ks[b], vs[b], positions(hist[b], chunk[b]), positions(0, totals[b]))
        _assert_close(out[cu[b] : cu[b + 1]], lse[:, cu[b] : cu[b + 1]], *ref)


# --- merges --------------------------------------------------------------------------------------------------


def _states(n: int, t: int = 6, h: int = 3, d: int = 24, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, t, h, d, generator=g).to(DEVICE, dtype)  # [N, T, H, D]
    lses = (3 * torch.randn(n, h, t, generator=g)).to(DEVICE)  # [N, H, T]
    # state 0 empty at token 0 (all heads), every state empty at (head 1, token 2)
    outs[0, 0] = 0
    lses[0, :, 0] = float("-inf")
    outs[:, 2, 1] = 0
    lses[:, 1, 2] = float("-inf")
    return outs, lses


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_two_matches_reference(dtype):
    outs, lses = _states(2, dtype=dtype)
    out, lse = tri.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    ref_out, ref_lse = ref.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    assert out.dtype == dtype
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    _assert_close(out, lse, ref_out, ref_lse, atol=atol, rtol=atol)
    assert torch.all(out[2, 1] == 0) and torch.isneginf(lse[1, 2])


@pytest.mark.parametrize("n", [1, 3, 20])
def test_merge_many_matches_reference(n):
    outs, lses = _states(n, seed=n)
    out, lse = tri.merge_attn_states_many(outs, lses)
    _assert_close(out, lse, *ref.merge_attn_states_many(outs, lses), atol=1e-6, rtol=1e-5)
    out_l, lse_l = tri.merge_attn_states_many(list(outs), list(lses))
    assert torch.equal(out_l, out) and torch.equal(lse_l, lse)


def test_merge_equals_attention_over_union():
    q, k, v = _qkv(37, 90, 9, 3, seed=7)
    full = _naive(q, k, v, positions(53, 37), positions(0, 90))
    a = tri.attention_fwd(q, k[:50], v[:50], q_offset=53, block_q=64, block_k=32)
    b = tri.attention_fwd(q, k[50:], v[50:], q_offset=53, k_offset=50, block_q=64, block_k=32)
    _assert_close(*tri.merge_attn_states(*a, *b), *full)


def test_merge_of_empty_states_stays_empty():
    out = torch.zeros(4, 3, 8, device=DEVICE)
    lse = torch.full((3, 4), float("-inf"), device=DEVICE)
    o, lse_m = tri.merge_attn_states(out, lse, out, lse)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse_m))
    o, lse_m = tri.merge_attn_states_many(torch.stack([out] * 3), torch.stack([lse] * 3))
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse_m))
    # empty merged with non-empty gives the non-empty state back, either way round
    x = torch.randn(4, 3, 8, device=DEVICE)
    lx = torch.randn(3, 4, device=DEVICE)
    for args in ((x, lx, out, lse), (out, lse, x, lx)):
        o, lse_m = tri.merge_attn_states(*args)
        assert torch.equal(o, x) and torch.equal(lse_m, lx)


def test_merge_rejects_bad_shapes():
    outs, lses = _states(2)
    with pytest.raises(ValueError, match="shape mismatch"):
        tri.merge_attn_states(outs[0], lses[0], outs[1, :3], lses[1])
    with pytest.raises(ValueError, match="expected outs"):
        tri.merge_attn_states_many(outs[0], lses)
    with pytest.raises(ValueError, match="at least one"):
        tri.merge_attn_states_many([], [])


@pytest.mark.parametrize("layout", ["contiguous", "stripe", "zigzag"])
def test_sp_shard_positions_run_on_the_kernel(layout):
    """What ring/ulysses attention runs on CUDA: a rank's shard against another's block plus history."""
    from spindle_attention.distributed import shard_positions
    from spindle_attention.distributed.local import triton_by_runs

    sp, n, hist = 3, 59, 23
    q_pos = shard_positions(n, sp, layout, 2, offset=hist)
    k_pos = torch.cat([shard_positions(n, sp, layout, 1, offset=hist), torch.arange(hist)])  # block + history
    q, k, v = _qkv(len(q_pos), len(k_pos), 9, 3, seed=11)
    state = triton_by_runs(q, k, v, q_pos.to(DEVICE), k_pos.to(DEVICE), 0.25)
    assert state is not None
    _assert_close(*state, *_naive(q, k, v, q_pos, k_pos, scale=0.25))


def test_scattered_positions_fall_back_to_the_reference():
    from spindle_attention.distributed.local import MAX_RUN_PAIRS, affine_runs, triton_by_runs

    assert affine_runs(torch.tensor([3, 5, 7, 8, 9, 20, 4])) == [
        (0, 3, 3, 2),
        (3, 2, 8, 1),
        (5, 1, 20, 1),
        (6, 1, 4, 1),
    ]
    pos = torch.randperm(64)
    assert affine_runs(pos, MAX_RUN_PAIRS) is None and len(affine_runs(pos)) ** 2 > MAX_RUN_PAIRS
    q, k, v = _qkv(64, 64, 4, 2)
    assert triton_by_runs(q, k, v, pos, pos, 0.25) is None
