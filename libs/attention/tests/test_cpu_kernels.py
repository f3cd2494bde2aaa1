"""Spindle's native CPU kernels (spindle_attention.cpu) against torch: paged decode and the packed small-batch
GEMM, in float32 and bfloat16, with shapes that do not divide the kernels' tiles."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spindle_attention import cpu, paged_decode

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs AVX-512 and a C compiler (CPU kernels off)")


def _cache(lens: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(1, max(-(-n // block_size) for n in lens))
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            table[i, j] = perm.pop()
    return k_cache, v_cache, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (8, 2, 72), (4, 4, 16)])
def test_paged_decode_matches_torch_path(dtype, hq, hkv, d):
    lens = [1, 59, 339, 0, 1500]  # 1500 tokens: several context splits per item
    k_cache, v_cache, table = _cache(lens, hkv, d, 16, dtype)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    seq_lens = torch.tensor(lens)
    out, lse = paged_decode(q, k_cache, v_cache, table, seq_lens)  # native (num_splits=None)
    ref, ref_lse = paged_decode(q, k_cache, v_cache, table, seq_lens, num_splits=1)  # torch
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse[:, [0, 1, 2, 4]], ref_lse[:, [0, 1, 2, 4]], atol=2e-5, rtol=1e-5)
    assert torch.all(out[3] == 0) and torch.isneginf(lse[:, 3]).all()


def test_paged_decode_bad_block_id_raises():
    k_cache, v_cache, table = _cache([40], 3, 64, 16, torch.float32)
    table[0, 1] = k_cache.shape[0] + 5
    with pytest.raises(IndexError, match="outside the cache"):
        paged_decode(torch.zeros(1, 9, 64), k_cache, v_cache, table, torch.tensor([40]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (130, 77), (7, 1536)])
def test_packed_gemm_matches_linear(dtype, n, k):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = cpu.PackedWeight(w)
    for m in (1, 5, 6, 13, cpu.MAX_ROWS):
        x = torch.randn(m, k, generator=g).to(dtype)
        ref = F.linear(x.double(), w.double())
        y = packed.linear(x, torch.float32)
        torch.testing.assert_close(y.double(), ref, atol=1e-3 * k**0.5, rtol=1e-4)
        assert packed.linear(x).dtype == dtype


def test_packed_gemm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g)
    packed = cpu.PackedWeight(w)
    x = torch.randn(11, 576, generator=g)
    batched = packed.linear(x)
    for i in (0, 6, 10):
        assert torch.equal(packed.linear(x[i : i + 1]), batched[i : i + 1])


def test_packed_gemm_rejects_bad_shapes():
    packed = cpu.PackedWeight(torch.randn(8, 16))
    with pytest.raises(ValueError, match="features"):
        packed.linear(torch.randn(2, 15))
    with pytest.raises(ValueError, match="2-D"):
        cpu.PackedWeight(torch.randn(8, 16, dtype=torch.float64))


def _gguf_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF rows of `kind` (raw uint8 [n, k/32 * block bytes]) and their float32 dequantization, computed
    as GGUF's reference does: d * q + m (Q4_1; low nibbles are weights 0-15, high ones 16-31) or d * q (Q8_0)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.standard_normal((n, nb, 1)) * 0.02).astype(np.float16)
    if kind == "Q4_1":
        m = (rng.standard_normal((n, nb, 1)) * 0.05).astype(np.float16)
        q = rng.integers(0, 16, (n, nb, 32), dtype=np.uint8)
        packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
        raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=-1)
        w = d.astype(np.float32) * q.astype(np.float32) + m.astype(np.float32)
    else:
        q = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
        w = d.astype(np.float32) * q.astype(np.float32)
    return raw.reshape(n, -1), torch.from_numpy(w.reshape(n, k))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(100, 64), (64, 96), (200, 576)])
def test_gguf_packed_gemm_equals_the_float32_kernel_bit_for_bit(kind, n, k):
    raw, w = _gguf_blocks(kind, n, k, seed=n + k)
    quantized, dense = cpu.GGUFPackedWeight(raw, kind, k), cpu.PackedWeight(w)
    assert quantized.data.numel() < dense.data.numel() * dense.data.element_size() / 3
    g = torch.Generator().manual_seed(0)
    for m in (1, 3, 4, 5, 13, cpu.MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        y = quantized.linear(x)
        assert torch.equal(y, dense.linear(x))  # same weights, same order of accumulation
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-4)
    x = torch.randn(9, k, generator=g)
    assert torch.equal(quantized.linear(x)[4:5], quantized.linear(x[4:5]))  # rows do not depend on the batch


def test_gguf_packed_weight_rejects_what_it_cannot_take():
    raw, _ = _gguf_blocks("Q4_1", 8, 64, seed=0)
    with pytest.raises(ValueError, match="no CPU kernel"):
        cpu.GGUFPackedWeight(raw, "Q6_K", 64)
    with pytest.raises(ValueError, match="multiple"):
        cpu.GGUFPackedWeight(raw, "Q4_1", 40)
    with pytest.raises(ValueError, match="expected uint8"):
        cpu.GGUFPackedWeight(raw[:, :-1], "Q4_1", 64)
    with pytest.raises(ValueError, match="features"):
        cpu.GGUFPackedWeight(raw, "Q4_1", 64).linear(torch.randn(2, 32))


@pytest.mark.parametrize(
    "env,why",
    [({"SPINDLE_CPU_KERNELS": "0"}, ""), ({"CC": "false"}, "building them failed")],
)
def test_without_the_kernels_everything_falls_back_to_torch(tmp_path, env, why):
    import os
    import subprocess
    import sys

    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from spindle_attention import cpu, paged_decode\n"
        "assert not cpu.available()\n"
        "k = torch.randn(4, 16, 3, 64)\n"
        "out, lse = paged_decode(torch.randn(1, 9, 64), k, k, torch.tensor([[2, 0]]), torch.tensor([20]))\n"
        "assert out.shape == (1, 9, 64) and torch.isfinite(lse).all()\n"
    )
    run_env = {**os.environ, "SPINDLE_CACHE_DIR": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert why in done.stderr


@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
def test_one_pass_rms_norm_and_silu_mul_equal_torch(rows: int) -> None:
    """The prefill row kernels (any row count, split over threads) agree with torch within fp32 rounding; other
    layouts and dtypes get None (the caller's torch path)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    w = torch.randn(576, generator=g)
    y = cpu.elementwise.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.elementwise.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    assert cpu.elementwise.rms_norm(x[:, ::2], w[:288], 1e-5) is None  # not contiguous
    assert cpu.elementwise.rms_norm(x.bfloat16(), w.bfloat16(), 1e-5) is None
    assert cpu.elementwise.silu_mul(gate_up[:, :-1]) is None  # odd width


@pytest.mark.parametrize(
    "hq,hkv,d,history,n,block_size",
    [
        (9, 3, 64, 0, 1, 16),  # one token, no history
        (9, 3, 64, 0, 203, 16),  # rows (609) not a multiple of the 6-row panels, keys not of the 64-key tiles
        (9, 3, 64, 1337, 77, 16),  # a chunk after an uneven history
        (8, 2, 128, 250, 131, 32),  # head dim 128 (two output halves)
        (4, 4, 64, 63, 2, 8),  # no GQA, a chunk crossing a tile boundary
        (8, 1, 64, 0, 700, 16),  # MQA: eight heads per KV head
    ],
)
def test_prefill_kernel_matches_the_torch_reference(hq, hkv, d, history, n, block_size):
    """The native chunked-prefill attention reads K/V through a shuffled block table and equals the tiled torch
    reference (positional causal mask) in out and lse within fp32 rounding."""
    from spindle_attention import paged_prefill

    total = history + n
    k_cache, v_cache, table = _cache([total], hkv, d, block_size, torch.float32, seed=n)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(7))
    assert cpu.prefill.supported(q, k_cache, v_cache)
    out, lse = cpu.prefill.attention(q, k_cache, v_cache, table[0], history, d**-0.5)
    slots = (table[0].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:total]
    k, v = k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots]
    from spindle_attention import attention_fwd

    ref, ref_lse = attention_fwd(q, k, v, q_offset=history, block_q=128, block_k=96)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
    # paged_prefill takes the native path on CPU: the same numbers
    via, via_lse = paged_prefill(q, k_cache, v_cache, table, torch.tensor([total]), torch.tensor([0, n]))
    assert torch.equal(via, out) and torch.equal(via_lse, lse)


def test_prefill_kernel_refuses_what_it_cannot_take():
    k_cache, v_cache, table = _cache([40], 3, 64, 16, torch.float32)
    q = torch.randn(8, 9, 64)
    assert not cpu.prefill.supported(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    assert not cpu.prefill.supported(torch.randn(8, 9, 72), torch.randn(4, 16, 3, 72), torch.randn(4, 16, 3, 72))
    bad = table[0].clone()
    bad[1] = k_cache.shape[0] + 5
    with pytest.raises(IndexError, match="outside the cache"):
        cpu.prefill.attention(q, k_cache, v_cache, bad, 32, 0.125)
    with pytest.raises(ValueError, match="block table covers"):
        cpu.prefill.attention(q, k_cache, v_cache, table[0], 60, 0.125)
