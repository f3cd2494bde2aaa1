"""The flash-attn backend's selection and layout conversions, on CPU, against a FAKE `flash_attn` module.

flash-attn cannot install or run without a GPU, so these tests inject into `sys.modules` a fake standing in
for it (`fake_flash_attn.py`, clearly not the real package) that keeps flash-attn 2's documented semantics and
input checks, computed with Spindle's reference in fp32. The adapter's output is held to the float64 oracle, so
every conversion it makes (layouts, index dtypes, causal alignment, lse signs, what it routes to its fallback)
is checked; flash-attn's own numerics are left to a GPU session of issue 28.
"""

import logging
import sys

import pytest
import torch

from spindle_attention import backends, positions
from spindle_attention import triton as tri
from spindle_attention.backends import registry
from spindle_attention.backends.flash import FlashAttnBackend
from spindle_attention.backends.reference import ReferenceBackend
from spindle_attention.testing import naive_attention, scatter_paged

from .fake_flash_attn import fake_flash_attn

BF16 = {"atol": 1e-2, "rtol": 1e-2}  # outputs rounded to bfloat16
LSE = {"atol": 2e-5, "rtol": 1e-5}  # the fake's lse is fp32 math on the same inputs


@pytest.fixture
def fa(monkeypatch):
    """The fake injected as `flash_attn`, on a machine whose torch.cuda answers as one with an sm80 GPU."""
    module = fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(registry, "_skips_logged", set())
    return module


@pytest.fixture
def flash(fa):
    """The adapter with the reference as its fallback (what cannot run on flash runs there)."""
    return FlashAttnBackend(torch.device("cuda"), fallback=ReferenceBackend(torch.device("cpu")))


# --- selection -----------------------------------------------------------------------------------------------


def test_auto_prefers_flash_on_cuda(fa):
    chosen = backends.select_backend("cuda:1")
    assert chosen.name == "flash-attn" and chosen.device == torch.device("cuda", 1)
    chain, step = [], chosen.fallback
    while step is not None:
        chain.append(step.name)
        step = step.fallback
    assert chain == (["triton", "reference"] if tri.available() else ["reference"])
    assert backends.available_backends("cuda", block_size=512)[0] == "flash-attn"


def test_block_size_flash_cannot_page_is_refused_at_selection(fa, caplog):
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        assert backends.select_backend("cuda", block_size=16).name != "flash-attn"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'flash-attn' skipped" in line and "multiple of 256" in line and "block_size=16" in line
    assert "flash-attn" not in backends.available_backends("cuda", block_size=16)
    with pytest.raises(ValueError, match="multiple of 256"):
        backends.select_backend("cuda", "flash-attn", block_size=16)
    assert backends.select_backend("cuda", "flash-attn", block_size=256).name == "flash-attn"


def test_older_gpu_version_or_api_is_refused(fa, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"Ampere or newer GPU \(sm80\+\), cuda:0 is sm75"):
        backends.select_backend("cuda:0", "flash-attn")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fa.__version__ = "2.5.9"
    with pytest.raises(ValueError, match=r"flash_attn 2\.5\.9 is older than 2\.6"):
        backends.select_backend("cuda", "flash-attn")
    fa.__version__ = "2.8.3"
    del fa.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="lacks flash_attn_with_kvcache"):
        backends.select_backend("cuda", "flash-attn")


# --- attention_fwd -------------------------------------------------------------------------------------------


def _bf16_varlen(q_lens, k_lens, hq=6, hkv=2, d=16, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)  # [Tq, Hq, D]
    k = torch.randn(sum(k_lens), hkv, d, generator=g).to(dtype)  # [Tk, Hkv, D]
    v = torch.randn(sum(k_lens), hkv, d, generator=g).to(dtype)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (q_lens, k_lens)]
    return q, k, v, cu[0], cu[1]


def _oracle(q, k, v, cu_q, cu_k, q_pos, k_pos, causal=True):
    outs, lses = [], []
    for b in range(len(q_pos)):
        qb, kb, vb = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        o, s = naive_attention(qb, kb, vb, q_pos[b], k_pos[b], causal=causal)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _assert_matches(out, lse, q, ref_out, ref_lse, lse_tol=LSE):
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, **BF16)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.isneginf(lse[~finite]).all()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **lse_tol)


def test_chunks_at_end_run_bottom_right_causal(fa, flash):
    # chunks after their history, a fresh prompt, one query, and a sequence with fewer keys than queries
    # (queries 0 and 1 see no key: flash's +inf lse must come back as -inf)
    q_lens, k_lens = [13, 37, 1, 5], [33, 37, 39, 3]
    q, k, v, cu_q, cu_k = _bf16_varlen(q_lens, k_lens, seed=1)
    q_off, k_off = torch.tensor([20, 0, 38, 0]), torch.tensor([0, 0, 0, 2])
    out, lse = flash.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_offset=q_off, k_offset=k_off)
    assert fa.calls == [("varlen", {"causal": True, "paged": False, "max_q": 37})]
    q_pos = [positions(o, n) for o, n in zip(q_off.tolist(), q_lens, strict=True)]
    k_pos = [positions(o, n) for o, n in zip(k_off.tolist(), k_lens, strict=True)]
    _assert_matches(out, lse, q, *_oracle(q, k, v, cu_q, cu_k, q_pos, k_pos))
    assert torch.isneginf(lse[:, -5:-3]).all() and torch.all(out[-5:-3] == 0)


def test_strided_shard_against_its_own_stripe_runs_causal(fa, flash):
    q, k, v, cu_q, cu_k = _bf16_varlen([23], [23], seed=2)
    kw = {"q_offset": 2, "k_offset": 1, "q_stride": 3, "k_stride": 3}
    out, lse = flash.attention_fwd(q, k, v, **kw)
    assert fa.calls == [("varlen", {"causal": True, "paged": False, "max_q": 23})]
    _assert_matches(out, lse, q, *_oracle(q, k, v, cu_q, cu_k, [positions(2, 23, 3)], [positions(1, 23, 3)]))


@pytest.mark.parametrize("explicit", [False, True])
def test_all_visible_and_non_causal_run_unmasked(fa, flash, explicit):
    q, k, v, cu_q, cu_k = _bf16_varlen([13, 4], [40, 0], seed=3)  # the second sequence has no keys
    if explicit:  # positions do not matter without a mask
        kw = {"causal": False, "q_positions": torch.arange(17) * 5, "k_positions": torch.arange(40) + 100}
        causal, q_pos, k_pos = False, [None, None], [None, None]
    else:  # a ring step over a past block
        kw = {"q_offset": 100}
        causal, q_pos, k_pos = True, [positions(100, 13), positions(100, 4)], [positions(0, 40), positions(0, 0)]
    out, lse = flash.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert fa.calls == [("varlen", {"causal": False, "paged": False, "max_q": 13})]
    q_pos = [p if p is not None else torch.zeros(n, dtype=torch.long) for p, n in zip(q_pos, [13, 4], strict=True)]
    k_pos = [p if p is not None else torch.zeros(n, dtype=torch.long) for p, n in zip(k_pos, [40, 0], strict=True)]
    _assert_matches(out, lse, q, *_oracle(q, k, v, cu_q, cu_k, q_pos, k_pos, causal=causal))
    assert torch.isneginf(lse[:, 13:]).all() and torch.all(out[13:] == 0)


@pytest.mark.parametrize(
    "case,reason",
    [
        ("explicit", "explicit q/k positions"),
        ("striped_behind", "a causal alignment other than bottom-right"),
        ("float32", "flash-attn runs float16 and bfloat16"),
        ("no_queries", "a sequence with no queries"),
    ],
)
def test_what_flash_cannot_express_runs_on_the_fallback(fa, flash, case, reason, caplog):
    q_lens, k_lens = ([0, 9], [5, 9]) if case == "no_queries" else ([11], [11])
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    q, k, v, cu_q, cu_k = _bf16_varlen(q_lens, k_lens, seed=4, dtype=dtype)
    q_pos, k_pos = [positions(0, n) for n in q_lens], [positions(0, n) for n in k_lens]
    kw = {}
    if case == "explicit":
        q_pos, k_pos = [torch.tensor([0, 2, 3, 5, 8, 9, 10, 14, 15, 20, 21])], [torch.arange(11) * 2]
        kw = {"q_positions": q_pos[0], "k_positions": k_pos[0]}
    elif case == "striped_behind":  # query i sees keys j < i
        kw = {"q_offset": 0, "k_offset": 2, "q_stride": 3, "k_stride": 3}
        q_pos, k_pos = [positions(0, 11, 3)], [positions(2, 11, 3)]
    elif case == "no_queries":
        q_pos, k_pos = [positions(5, 0), positions(0, 9)], [positions(0, 5), positions(0, 9)]
        kw = {"q_offset": torch.tensor([5, 0])}
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        out, lse = flash.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert fa.calls == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'flash-attn' cannot run attention_fwd with" in line and reason in line and "run on 'reference'" in line
    _assert_matches(out, lse, q, *_oracle(q, k, v, cu_q, cu_k, q_pos, k_pos), lse_tol=BF16)


# --- paged decode and prefill ---------------------------------------------------------------------------------


def _paged_kv(lens, hkv, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, hkv, 16, generator=g).to(torch.bfloat16) for n in lens]
    vs = [torch.randn(n, hkv, 16, generator=g).to(torch.bfloat16) for n in lens]
    k_cache, table = scatter_paged(ks, block_size, seed=seed)
    v_cache, _ = scatter_paged(vs, block_size, seed=seed)
    return ks, vs, k_cache, v_cache, table  # table int64: the adapter hands flash int32


def test_paged_decode_through_kvcache_entry(fa, flash):
    lens = [1, 300, 513, 0, 256]  # partial last blocks, an empty sequence, an exactly full block
    ks, vs, k_cache, v_cache, table = _paged_kv(lens, 2, 256, seed=5)
    q = torch.randn(len(lens), 8, 16, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)  # [B, Hq, D]
    out, lse = flash.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens))
    assert fa.calls == [("kvcache", {"causal": True, "q_shape": (5, 1, 8, 16)})]
    ref = [
        naive_attention(q[b : b + 1], ks[b], vs[b], positions(max(n - 1, 0), 1), positions(0, n))
        for b, n in enumerate(lens)
    ]
    _assert_matches(out, lse, q, torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref], dim=1))
    assert torch.all(out[3] == 0) and torch.isneginf(lse[:, 3]).all()


def test_paged_prefill_through_varlen_block_table(fa, flash):
    hist, chunk = [0, 250, 3, 600], [7, 13, 1, 40]
    totals = [h + c for h, c in zip(hist, chunk, strict=True)]
    ks, vs, k_cache, v_cache, table = _paged_kv(totals, 2, 256, seed=7)
    q = torch.randn(sum(chunk), 6, 16, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    cu = torch.tensor([0, 7, 20, 21, 61])
    out, lse = flash.paged_prefill(q, k_cache, v_cache, table, torch.tensor(totals), cu)
    assert fa.calls == [("varlen", {"causal": True, "paged": True, "max_q": 40})]
    ref = [
        naive_attention(q[cu[b] : cu[b + 1]], ks[b], vs[b], positions(hist[b], chunk[b]), positions(0, totals[b]))
        for b in range(4)
    ]
    _assert_matches(out, lse, q, torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref], dim=1))


def test_paged_ops_on_small_blocks_fall_back(fa, flash, caplog):
    ks, vs, k_cache, v_cache, table = _paged_kv([5, 40], 2, 16, seed=9)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        out, lse = flash.paged_decode(q, k_cache, v_cache, table, torch.tensor([5, 40]))
    assert fa.calls == []
    assert "block size is not a multiple of 256" in caplog.records[0].getMessage()
    ref = [
        naive_attention(q[b : b + 1], ks[b], vs[b], positions(n - 1, 1), positions(0, n)) for b, n in enumerate([5, 40])
    ]
    _assert_matches(out, lse, q, torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref], dim=1), lse_tol=BF16)


def test_paged_decode_checks_capacity(fa, flash):
    _, _, k_cache, v_cache, table = _paged_kv([300], 2, 256, seed=11)
    with pytest.raises(ValueError, match="exceeds block_table capacity 512"):
        flash.paged_decode(torch.zeros(1, 6, 16, dtype=torch.bfloat16), k_cache, v_cache, table, torch.tensor([600]))
