"""The `cpu` backend: Spindle's native CPU kernels (`spindle_attention.cpu`), where they are built.

The paged ops are `spindle_attention.paged`'s, which already dispatch to the native decode and prefill kernels
for the operands those take (float32/bfloat16 decode, float32 prefill with a head dim that is a multiple of 64)
and run torch for the rest. `attention_fwd` runs the native prefill kernel over contiguous K/V when every
sequence is a causal chunk at the end of its keys (a fresh prompt, a chunk after its history); other masks,
non-causal calls and operands the kernel does not take raise `Unsupported`, and the reference runs them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import cpu as native
from .. import paged
from ..reference import _check_qkv, _split
from .alignment import all_at_end, causal_shifts
from .base import AttentionBackend, FwdArgs, Unsupported
from .registry import register_backend


@register_backend("cpu")
class NativeCpuBackend(AttentionBackend):
    """The native decode and prefill kernels (AVX-512, built on first use), torch for what they do not take."""

    @classmethod
    def unavailable(cls, device: torch.device, block_size: int | None) -> str | None:
        if device.type != "cpu":
            return "Spindle's native CPU kernels run on CPU tensors only"
        if not native.available():
            return "Spindle's native CPU kernels are off here (they need AVX-512 and a C compiler; see the log)"
        return None

    def _attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
        _check_qkv(q, k, v)
        if not args.causal:
            raise Unsupported("a non-causal mask (the native prefill kernel is causal)")
        q_starts, q_lens = _split(args.cu_seqlens_q, q.shape[0])
        k_starts, k_lens = _split(args.cu_seqlens_k, k.shape[0])
        if len(q_lens) != len(k_lens):
            raise ValueError(f"{len(q_lens)} query sequences but {len(k_lens)} key sequences")
        shifts = causal_shifts(args, len(q_lens))
        if not all_at_end(shifts, q_lens, k_lens) or any(0 < nk < nq for nq, nk in zip(q_lens, k_lens, strict=True)):
            raise Unsupported("a mask other than causal chunks at the end of their keys")
        k, v = k.contiguous(), v.contiguous()
        if not native.prefill.supported(q, k.unsqueeze(0), v.unsqueeze(0)):
            raise Unsupported("operands the native prefill kernel does not take (float32, head_dim a multiple of 64)")
        tq, hq, d = q.shape
        scale = args.softmax_scale if args.softmax_scale is not None else 1.0 / math.sqrt(d)
        table = torch.zeros(1, dtype=torch.int64)  # the sequence's keys are one block of the "cache" k[None]
        out = torch.zeros(tq, hq, d, dtype=q.dtype)  # [Tq, Hq, D]; a sequence with no keys keeps (0, -inf)
        lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32)  # [Hq, Tq]
        for qs, nq, ks, nk in zip(q_starts, q_lens, k_starts, k_lens, strict=True):
            if nq == 0 or nk == 0:
                continue
            keys, values = k[ks : ks + nk].unsqueeze(0), v[ks : ks + nk].unsqueeze(0)  # [1, nk, Hkv, D]
            o, s = native.prefill.attention(q[qs : qs + nq], keys, values, table, nk - nq, scale)
            out[qs : qs + nq] = o
            lse[:, qs : qs + nq] = s
        return out, lse

    def _paged_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        out, lse = paged.paged_decode(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale)
        assert lse is not None
        return out, lse

    def _paged_prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        cu_seqlens_q: Tensor,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        return paged.paged_prefill(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, softmax_scale=softmax_scale
        )
