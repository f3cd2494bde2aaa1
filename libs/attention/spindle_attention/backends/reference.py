"""The `reference` backend: the torch implementations at the package top level, on any device.

It is the oracle every other backend is tested against and the last fallback, so it expresses every call and
never raises `Unsupported`. On CPU it keeps the torch path even where the native kernels are built
(`native=False`); the `cpu` backend is the one that runs them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import paged, reference
from .base import AttentionBackend, FwdArgs
from .registry import register_backend


@register_backend("reference")
class ReferenceBackend(AttentionBackend):
    """`spindle_attention.attention_fwd`, `paged_decode` and `paged_prefill` in torch."""

    @classmethod
    def unavailable(cls, device: torch.device, block_size: int | None) -> str | None:
        return None

    def _attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
        out, lse = reference.attention_fwd(q, k, v, **args.kwargs())
        assert lse is not None
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
        out, lse = paged.paged_decode(
            q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale, native=False
        )
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
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, softmax_scale=softmax_scale, native=False
        )
