"""The `triton` backend: `spindle_attention.triton`'s kernels, on CUDA or on CPU under triton's interpreter.

Choosing it never imports triton (the kernels import it on their first launch, and on CPU triton must not be
imported before `TRITON_INTERPRET=1` is set). Explicit `q_positions`/`k_positions` raise `Unsupported` (the
kernel derives positions from offset and stride), and the fallback runs those calls.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .. import triton as tri
from .base import AttentionBackend, FwdArgs, Unsupported
from .registry import register_backend


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for triton's interpreter (read without importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@register_backend("triton")
class TritonBackend(AttentionBackend):
    """Flash-attention forward, split-KV paged decode and paged prefill kernels in Triton."""

    @classmethod
    def unavailable(cls, device: torch.device, block_size: int | None) -> str | None:
        if not tri.available():
            return "the triton package is not installed (pip install 'spindle-attention[triton]')"
        if device.type == "cuda":
            return None if torch.cuda.is_available() else f"CUDA is not available (torch {torch.__version__})"
        if device.type == "cpu":
            if interpreting():
                return None
            return "on CPU the Triton kernels run only under triton's interpreter: set TRITON_INTERPRET=1"
        return f"the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1), not on {device.type}"

    def _attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
        if args.q_positions is not None or args.k_positions is not None:
            raise Unsupported("explicit q/k positions")
        out, lse = tri.attention_fwd(q, k, v, **args.kwargs())
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
        return tri.paged_decode(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale)

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
        return tri.paged_prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, softmax_scale=softmax_scale)
