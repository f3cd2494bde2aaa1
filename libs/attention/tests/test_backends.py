"""The attention backend registry: selection per device and request, and every backend usable here held to the
same exactness test against the float64 oracle (varlen GQA batches with odd lengths, strided and explicit
positions, paged decode and prefill with partial last blocks).

The triton backend runs in fp32 under TRITON_INTERPRET=1 (set here, before anything imports triton, as in
test_triton_kernels.py). CUDA is never touched: selection on "cuda" devices is checked against a monkeypatched
`torch.cuda`. The flash-attn adapter has its own file (test_backends_flash.py).
"""

import logging
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spindle_attention import backends, positions
from spindle_attention.backends import registry
from spindle_attention.backends.alignment import causal_shifts
from spindle_attention.testing import naive_attention, scatter_paged

CPU_BACKENDS = ["reference", "cpu", "triton"]


@pytest.fixture
def fresh_skip_log(monkeypatch):
    monkeypatch.setattr(registry, "_skips_logged", set())


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as a machine with an sm90 GPU would (no kernel runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _backend(name: str) -> backends.AttentionBackend:
    if name not in backends.available_backends("cpu"):
        pytest.skip(
            f"backend {name!r} cannot run here: {backends.get_backend(name).unavailable(torch.device('cpu'), None)}"
        )
    return backends.select_backend("cpu", name)


# --- registry and selection -----------------------------------------------------------------------------------


def test_registry_names_and_lookup():
    assert backends.backend_names() == ("cpu", "flash-attn", "reference", "triton")
    for name in backends.backend_names():
        assert backends.get_backend(name).name == name
    with pytest.raises(ValueError, match="choose one of: auto, cpu, flash-attn, reference, triton"):
        backends.get_backend("flash")


def test_register_rejects_duplicates_and_auto():
    class Dummy(backends.get_backend("reference")):
        pass

    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend("triton")(Dummy)
    with pytest.raises(ValueError, match="cannot name"):
        backends.register_backend("auto")(Dummy)
    assert backends.get_backend("triton").__name__ == "TritonBackend"


def test_auto_on_cpu_takes_native_kernels_else_reference(monkeypatch, fresh_skip_log, caplog):
    expected = "cpu" if backends.get_backend("cpu").unavailable(torch.device("cpu"), None) is None else "reference"
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        chosen = backends.select_backend("cpu")
        assert chosen.name == expected and chosen.device == torch.device("cpu")
        monkeypatch.setattr(backends.native_cpu.native, "available", lambda: False)
        for _ in range(3):
            assert backends.select_backend("cpu", "auto").name == "reference"
    lines = [r.getMessage() for r in caplog.records if r.name == "spindle.attention"]
    assert len(lines) == 1 and "'cpu' skipped" in lines[0] and "using 'reference'" in lines[0]


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 1)])
def test_auto_on_cuda_without_flash_takes_triton(device, fake_cuda, monkeypatch, fresh_skip_log, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` fails as when not installed
    monkeypatch.setattr(backends.triton.tri, "available", lambda: True)  # as where triton is installed
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        chosen = backends.select_backend(device)
        backends.select_backend(device)
    assert chosen.name == "triton" and chosen.device == torch.device(device)
    assert chosen.fallback is not None and chosen.fallback.name == "reference" and chosen.fallback.fallback is None
    lines = [r.getMessage() for r in caplog.records if r.name == "spindle.attention"]
    assert len(lines) == 1, lines  # one line per skipped backend, once per process
    assert "'flash-attn' skipped" in lines[0] and "not installed" in lines[0] and "spindle-attention[gpu]" in lines[0]
    with pytest.raises(ValueError, match=r"'flash-attn' cannot run on cuda.*not installed"):
        backends.select_backend(device, "flash-attn")


def test_auto_on_cuda_without_cuda_or_triton_takes_reference(monkeypatch, fresh_skip_log, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        assert backends.select_backend("cuda").name == "reference"
    assert len([r for r in caplog.records if r.name == "spindle.attention"]) == 2  # flash-attn, triton
    with pytest.raises(ValueError, match="'triton' cannot run on cuda: CUDA is not available"):
        backends.select_backend("cuda", "triton")
    monkeypatch.setitem(sys.modules, "triton", None)
    assert "not installed" in backends.get_backend("triton").unavailable(torch.device("cuda"), None)


def test_requested_backends_on_cpu(monkeypatch):
    assert backends.select_backend("cpu", "reference").fallback is None
    with pytest.raises(ValueError, match="'flash-attn' cannot run on cpu: flash-attn runs on CUDA devices only"):
        backends.select_backend("cpu", "flash-attn")
    with pytest.raises(ValueError, match="unknown attention backend 'torch'; choose one of: auto, cpu"):
        backends.select_backend("cpu", "torch")
    with pytest.raises(ValueError, match="device must be"):
        backends.select_backend("gpu0")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        backends.select_backend("cpu", block_size=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in backends.available_backends("cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backends.select_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if "triton" in backends.available_backends("cpu"):  # triton installed
        assert backends.select_backend("cpu", "triton").fallback.name == "reference"


def test_cpu_backend_refuses_cuda(fake_cuda):
    with pytest.raises(ValueError, match="CPU tensors only"):
        backends.select_backend("cuda", "cpu")


def test_other_device_types_get_the_reference():
    assert backends.preference(torch.device("meta")) == ("reference",)
    assert backends.select_backend("meta").name == "reference"


def test_fwd_args_are_validated():
    ref = backends.select_backend("cpu", "reference")
    q = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="strides must be >= 1"):
        ref.attention_fwd(q, q, q, q_stride=0)
    with pytest.raises(ValueError, match="both cu_seqlens"):
        ref.attention_fwd(q, q, q, cu_seqlens_q=torch.tensor([0, 4]))


def test_causal_shifts():
    args = backends.FwdArgs(q_offset=torch.tensor([5, 0, 7]), k_offset=torch.tensor([0, 2, 1]), q_stride=3, k_stride=3)
    assert causal_shifts(args, 3) == [1, -1, 2]  # floor((q_offset - k_offset) / stride)
    with pytest.raises(backends.Unsupported, match="strides"):
        causal_shifts(backends.FwdArgs(q_stride=2), 1)
    with pytest.raises(backends.Unsupported, match="explicit"):
        causal_shifts(backends.FwdArgs(k_positions=torch.arange(3)), 1)


# --- exactness: attention_fwd ----------------------------------------------------------------------------------


def _varlen(q_lens, k_lens, hq, hkv, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g)  # [Tq, Hq, D]
    k = torch.randn(sum(k_lens), hkv, d, generator=g)  # [Tk, Hkv, D]
    v = torch.randn(sum(k_lens), hkv, d, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    return q, k, v, cu_q, cu_k


def _case(name):
    """(q_lens, k_lens, attention_fwd kwargs, per-sequence q positions, k positions, causal)."""
    if name == "chunks_at_end":  # fresh prompts and chunks after their history
        hist, chunk = [0, 20, 5], [1, 13, 37]
        k_lens = [h + c for h, c in zip(hist, chunk, strict=True)]
        kw = {"q_offset": torch.tensor(hist), "k_offset": 0}
        return (
            chunk,
            k_lens,
            kw,
            [positions(h, c) for h, c in zip(hist, chunk, strict=True)],
            [positions(0, n) for n in k_lens],
            True,
        )
    if name == "non_causal":
        return (
            [3, 17],
            [29, 1],
            {"causal": False, "q_offset": 40},
            [positions(40, 3), positions(40, 17)],
            [positions(0, 29), positions(0, 1)],
            False,
        )
    if name == "striped_own":  # a striped shard against its own stripe: shift 0
        kw = {"q_offset": 2, "k_offset": 1, "q_stride": 3, "k_stride": 3}
        return [23], [23], kw, [positions(2, 23, 3)], [positions(1, 23, 3)], True
    if name == "striped_behind":  # a stripe ahead of the queries: query i sees keys j < i
        kw = {"q_offset": 0, "k_offset": 2, "q_stride": 3, "k_stride": 3}
        return [23], [23], kw, [positions(0, 23, 3)], [positions(2, 23, 3)], True
    if name == "ring_past":  # every key in every query's past
        return [13], [40], {"q_offset": 100}, [positions(100, 13)], [positions(0, 40)], True
    assert name == "explicit", name
    qp = torch.tensor([0, 3, 4, 9, 10, 11, 30])
    kp = torch.tensor([1, 2, 3, 5, 8, 9, 12, 13, 31, 40, 41])
    return [7], [11], {"q_positions": qp, "k_positions": kp}, [qp], [kp], True


CASES = ["chunks_at_end", "non_causal", "striped_own", "striped_behind", "ring_past", "explicit"]
# the cases each backend's kernels cannot express, which its fallback (the reference) runs
FALLS_BACK = {
    "reference": set(),
    "cpu": {"non_causal", "striped_behind", "ring_past", "explicit"},
    "triton": {"explicit"},
}


def _assert_matches(out, lse, q, ref_out, ref_lse, atol=2e-5, rtol=1e-4):
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[1], q.shape[0])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.isneginf(lse[~finite]).all()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_attention_fwd_matches_oracle(name, case, caplog):
    backend = _backend(name)
    q_lens, k_lens, kw, q_pos, k_pos, causal = _case(case)
    q, k, v, cu_q, cu_k = _varlen(q_lens, k_lens, hq=6, hkv=2, seed=len(case))
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        out, lse = backend.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    fell_back = [r.getMessage() for r in caplog.records if "cannot run attention_fwd" in r.getMessage()]
    assert len(fell_back) == (case in FALLS_BACK[name]), fell_back
    ref_out, ref_lse = [], []
    for b in range(len(q_lens)):
        qb, kb, vb = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        o, s = naive_attention(qb, kb, vb, q_pos[b], k_pos[b], causal=causal)
        ref_out.append(o)
        ref_lse.append(s)
    _assert_matches(out, lse, q, torch.cat(ref_out), torch.cat(ref_lse, dim=1))


def test_native_cpu_runs_what_it_can_and_falls_back_once(caplog):
    backend = _backend("cpu")
    q, k, v, cu_q, cu_k = _varlen([5, 9], [5, 12], hq=6, hkv=2)
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        backend.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_offset=torch.tensor([0, 3]))
        assert not caplog.records  # the native kernel ran it
        for _ in range(2):
            backend.attention_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'cpu' cannot run attention_fwd with a non-causal mask" in lines[0]
    assert "run on 'reference'" in lines[0]


# --- exactness: paged decode and prefill ---------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", [(6, 2), (9, 3)])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_paged_decode_matches_oracle(name, hq, hkv):
    backend = _backend(name)
    lens = [1, 17, 40, 0, 33]
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(n, hkv, 64, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, 64, generator=g) for n in lens]
    q = torch.randn(len(lens), hq, 64, generator=g)  # [B, Hq, D]
    k_cache, table = scatter_paged(ks, 16, seed=4)
    v_cache, _ = scatter_paged(vs, 16, seed=4)
    out, lse = backend.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens))
    ref = [
        naive_attention(q[b : b + 1], ks[b], vs[b], positions(max(n - 1, 0), 1), positions(0, n))
        for b, n in enumerate(lens)
    ]
    _assert_matches(out, lse, q, torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref], dim=1))
    assert torch.all(out[3] == 0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_paged_prefill_matches_oracle(name):
    backend = _backend(name)
    hist, chunk = [0, 20, 37], [5, 13, 1]
    totals = [h + c for h, c in zip(hist, chunk, strict=True)]
    g = torch.Generator().manual_seed(5)
    ks = [torch.randn(n, 2, 64, generator=g) for n in totals]
    vs = [torch.randn(n, 2, 64, generator=g) for n in totals]
    q = torch.randn(sum(chunk), 6, 64, generator=g)  # [Tq, Hq, D]
    k_cache, table = scatter_paged(ks, 16, seed=6)
    v_cache, _ = scatter_paged(vs, 16, seed=6)
    cu = torch.tensor([0, 5, 18, 19])
    out, lse = backend.paged_prefill(q, k_cache, v_cache, table, torch.tensor(totals), cu)
    ref = [
        naive_attention(q[cu[b] : cu[b + 1]], ks[b], vs[b], positions(hist[b], chunk[b]), positions(0, totals[b]))
        for b in range(3)
    ]
    _assert_matches(out, lse, q, torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref], dim=1))
