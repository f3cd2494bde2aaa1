"""A FAKE `flash_attn` module for CPU tests: NOT the flash-attn package, and never shipped.

flash-attn cannot be installed or run without a GPU, which is the only reason this stand-in exists: it lets the
tests of `spindle_attention.backends.flash` check the adapter's conversions on CPU. Its two entry points take
flash-attn 2's documented arguments and keep its documented semantics: bottom-right causal alignment (query i
sees key j iff j <= i + Lk - Lq), softmax lse `[H, total_q]` from the varlen entry and `[B, H, Sq]` from the
KV-cache entry, +inf lse for a query that sees no key, paged KV read through `block_table` with
`cache_seqlens` (KV-cache entry) or cumulative `cu_seqlens_k` (varlen entry), and its input checks (fp16/bf16,
contiguous int32 index tensors, last dim contiguous, head_dim a multiple of 8 up to 256, block size a multiple
of 256, max_seqlen at least each sequence's length). The numbers come from Spindle's reference in fp32, so only
the adapter's conversions are under test, not flash-attn's numerics.
"""

import types

import torch

from spindle_attention import reference


def fake_flash_attn(version: str = "2.8.3") -> types.ModuleType:
    """A FAKE `flash_attn` (only because flash-attn cannot run without a GPU), recording its calls."""
    fa = types.ModuleType("flash_attn")
    fa.__version__ = version
    fa.calls = []

    def check(q, k, v, *indices):
        if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise RuntimeError("Input tensor must have contiguous last dimension")
        if any(t is not None and (t.dtype != torch.int32 or not t.is_contiguous()) for t in indices):
            raise RuntimeError("index tensors must be contiguous int32")
        if q.shape[-1] % 8 or q.shape[-1] > 256 or q.shape[-2] % k.shape[-2]:
            raise RuntimeError("bad head_dim or head counts")
        if k.dim() == 4 and k.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")

    def attend(q, k, v, causal, scale):
        """One sequence, flash semantics: query i sees key j iff j <= i + Lk - Lq; +inf lse where none."""
        out, lse = reference.attention_fwd(
            q.float(), k.float(), v.float(), causal=causal, q_offset=k.shape[0] - q.shape[0], softmax_scale=scale
        )
        return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf"))

    def gather(cache, row, n):  # the first n tokens of a paged sequence: [n, Hkv, D]
        t = torch.arange(n)
        return cache[row[t // cache.shape[1]].long(), t % cache.shape[1]]

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        check(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
        assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        if max(q_lens) > max_seqlen_q or max(k_lens) > max_seqlen_k:
            raise RuntimeError("max_seqlen below a sequence's length: flash would skip its tail")
        fa.calls.append(("varlen", {"causal": causal, "paged": block_table is not None, "max_q": max_seqlen_q}))
        outs, lses = [], []
        for b, (qs, nq, ks, nk) in enumerate(
            zip(cu_seqlens_q[:-1].tolist(), q_lens, cu_seqlens_k[:-1].tolist(), k_lens, strict=True)
        ):
            if block_table is None:
                keys, values = k[ks : ks + nk], v[ks : ks + nk]
            else:
                keys, values = gather(k, block_table[b], nk), gather(v, block_table[b], nk)
            o, s = attend(q[qs : qs + nq], keys, values, causal, softmax_scale)
            outs.append(o)
            lses.append(s)
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)  # [total_q, H, D], [H, total_q]
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        assert k is None and v is None, "the adapter must not append to the cache"
        assert rotary_cos is None and rotary_sin is None, "Spindle's q/k arrive rotated: flash must apply no rotary"
        assert cache_batch_idx is None and cache_leftpad is None and block_table is not None
        check(q, k_cache, v_cache, cache_seqlens, block_table)
        fa.calls.append(("kvcache", {"causal": causal, "q_shape": tuple(q.shape)}))
        outs, lses = [], []
        for b, n in enumerate(cache_seqlens.tolist()):
            keys, values = gather(k_cache, block_table[b], n), gather(v_cache, block_table[b], n)
            o, s = attend(q[b], keys, values, causal, softmax_scale)  # [Sq, H, D], [H, Sq]
            outs.append(o)
            lses.append(s)
        out, lse = torch.stack(outs), torch.stack(lses)  # [B, Sq, H, D], [B, H, Sq]
        return (out, lse) if return_softmax_lse else out

    fa.flash_attn_varlen_func = flash_attn_varlen_func
    fa.flash_attn_with_kvcache = flash_attn_with_kvcache
    return fa
