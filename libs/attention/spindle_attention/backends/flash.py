"""The `flash-attn` backend: Spindle's attention ops on the `flash_attn` package (FlashAttention-2, >= 2.6).

Entry points: `flash_attn_varlen_func(..., return_attn_probs=True)` for `attention_fwd` and (with `block_table`)
`paged_prefill`; `flash_attn_with_kvcache(..., return_softmax_lse=True)` for `paged_decode`.

Layouts. Spindle and flash-attn agree on token-major q/k/v `[tokens, heads, head_dim]`, on GQA by head groups
(query head h reads KV head h // (Hq // Hkv)) and on the paged cache `[num_blocks, block_size, Hkv, D]`. The
adapter converts the rest: index tensors to contiguous int32 on q's device, `seq_lens` to the cumulative
`cu_seqlens_k` of paged prefill, decode's q `[B, Hq, D]` to `[B, 1, Hq, D]` and its lse `[B, Hq, 1]` to
`[Hq, B]` (varlen lse is already `[Hq, total_q]` fp32), and flash's +inf lse of a query that sees no key to
Spindle's -inf (its output row is 0 in both).

Masking. flash-attn aligns the causal mask to the bottom-right corner: in a sequence of Lq queries and Lk keys,
query i sees key j iff j <= i + Lk - Lq. Spindle masks by positions (see `alignment`); flash runs a call when
every sequence is a chunk at the end of its keys (prefill, chunked prefill, a ring step on the diagonal, a
striped shard against its own stripe) or every query sees every key (a ring step over a past block: run
unmasked), and when the mask is off. Explicit positions, different query and key strides, and batches mixing
other alignments raise `Unsupported`, and the fallback (triton, else the reference) runs them.

Limits, checked before launching (`Unsupported` otherwise): float16/bfloat16, head_dim a multiple of 8 up to
256, every varlen sequence with at least one query, a KV cache contiguous in its last dim. flash-attn 2's paged
KV needs a block size that is a multiple of 256: `select_backend(..., block_size=...)` refuses the backend for
another block size, and a paged call on such a cache falls back.

RoPE. Spindle rotates q and k in the model (interleaved pairs, `spindle_model.layers.apply_rope`) before
attention, and the cache holds rotated keys. The adapter never passes `rotary_cos`/`rotary_sin` (nor new
`k`/`v`) to `flash_attn_with_kvcache`, so flash applies no rotary and writes nothing into the cache.
"""

from __future__ import annotations

import importlib
import itertools
import math
import re

import torch
from torch import Tensor

from ..paged import _check_cache
from ..reference import _check_qkv, _split
from .alignment import all_at_end, all_visible, causal_shifts
from .base import AttentionBackend, FwdArgs, Unsupported
from .registry import register_backend

MIN_VERSION = (2, 6)
PAGE_MULTIPLE = 256  # flash-attn 2: "Paged KV cache block size must be divisible by 256"
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
INSTALL = "pip install 'spindle-attention[gpu]'"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def _int32(t: Tensor, device: torch.device) -> Tensor:
    return t.to(device=device, dtype=torch.int32).contiguous()


def _cu_seqlens(cu: Tensor | None, total: int, device: torch.device) -> Tensor:
    if cu is None:
        return torch.tensor([0, total], dtype=torch.int32, device=device)
    return _int32(cu, device)


def _spindle_lse(lse: Tensor) -> Tensor:
    """flash-attn's lse (+inf where a query sees no key) -> Spindle's (-inf there), fp32."""
    lse = lse.float()
    return lse.masked_fill(torch.isposinf(lse), float("-inf"))


@register_backend("flash-attn")
class FlashAttnBackend(AttentionBackend):
    """FlashAttention-2's varlen and KV-cache forward kernels (Ampere or newer GPUs)."""

    def __init__(self, device: torch.device, fallback: AttentionBackend | None = None) -> None:
        super().__init__(device, fallback)
        self._fa = importlib.import_module("flash_attn")

    @classmethod
    def unavailable(cls, device: torch.device, block_size: int | None) -> str | None:
        if device.type != "cuda":
            return "flash-attn runs on CUDA devices only"
        try:
            fa = importlib.import_module("flash_attn")
        except ModuleNotFoundError as e:
            if e.name == "flash_attn":
                return f"the flash_attn package is not installed ({INSTALL})"
            return f"importing flash_attn failed: {e}"
        except (ImportError, OSError, RuntimeError) as e:
            return f"importing flash_attn failed: {e}"
        version = str(getattr(fa, "__version__", "0"))
        if _version(version) < MIN_VERSION:
            return f"flash_attn {version} is older than {'.'.join(map(str, MIN_VERSION))} ({INSTALL})"
        missing = [f for f in ("flash_attn_varlen_func", "flash_attn_with_kvcache") if not hasattr(fa, f)]
        if missing:
            return f"flash_attn {version} lacks {', '.join(missing)}"
        if not torch.cuda.is_available():
            return f"CUDA is not available (torch {torch.__version__})"
        try:
            major, minor = torch.cuda.get_device_capability(device)
        except (RuntimeError, AssertionError, ValueError) as e:
            return f"cannot query {device}: {e}"
        if major < 8:
            return f"flash-attn 2 needs an Ampere or newer GPU (sm80+), {device} is sm{major}{minor}"
        if block_size is not None and block_size % PAGE_MULTIPLE:
            return (
                f"flash-attn's paged KV cache needs a block size that is a multiple of {PAGE_MULTIPLE}, and this "
                f"cache has block_size={block_size} (use block_size={PAGE_MULTIPLE}, or another backend)"
            )
        return None

    def _check_operands(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise Unsupported(f"dtype {q.dtype} (flash-attn runs float16 and bfloat16, q, k and v alike)")
        d = q.shape[-1]
        if d % 8 or d > MAX_HEAD_DIM:
            raise Unsupported(f"head_dim {d} (flash-attn takes multiples of 8 up to {MAX_HEAD_DIM})")

    def _check_paged(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor) -> None:
        _check_cache(k_cache, v_cache, block_table)
        if q.shape[-1] != k_cache.shape[-1]:
            raise ValueError(f"head_dim differs: q {q.shape[-1]} vs cache {k_cache.shape[-1]}")
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})")
        self._check_operands(q, k_cache, v_cache)
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise Unsupported(f"a paged KV cache whose block size is not a multiple of {PAGE_MULTIPLE}")
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise Unsupported("a KV cache that is not contiguous in its last dim")

    def _attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
        _check_qkv(q, k, v)
        self._check_operands(q, k, v)
        tq, hq, d = q.shape
        _, q_lens = _split(args.cu_seqlens_q, tq)
        _, k_lens = _split(args.cu_seqlens_k, k.shape[0])
        if len(q_lens) != len(k_lens):
            raise ValueError(f"{len(q_lens)} query sequences but {len(k_lens)} key sequences")
        if tq == 0 or max(k_lens) == 0:
            empty = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)  # [Hq, Tq]
            return q.new_zeros(tq, hq, d), empty
        if min(q_lens) == 0:
            raise Unsupported("a sequence with no queries")
        causal = args.causal
        if causal:
            shifts = causal_shifts(args, len(q_lens))
            if not all_at_end(shifts, q_lens, k_lens):
                if not all_visible(shifts, q_lens, k_lens):
                    raise Unsupported("a causal alignment other than bottom-right")
                causal = False  # every key is in every query's past
        scale = args.softmax_scale if args.softmax_scale is not None else 1.0 / math.sqrt(d)
        out, lse, _ = self._fa.flash_attn_varlen_func(
            q if q.stride(-1) == 1 else q.contiguous(),
            k if k.stride(-1) == 1 else k.contiguous(),
            v if v.stride(-1) == 1 else v.contiguous(),
            _cu_seqlens(args.cu_seqlens_q, tq, q.device),
            _cu_seqlens(args.cu_seqlens_k, k.shape[0], q.device),
            max(q_lens),
            max(k_lens),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
        return out, _spindle_lse(lse)  # [Tq, Hq, D], [Hq, Tq]

    def _paged_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        if q.dim() != 3:
            raise ValueError(f"q must be [batch, heads, head_dim]; got {tuple(q.shape)}")
        self._check_paged(q, k_cache, v_cache, block_table)
        b, hq, d = q.shape
        if block_table.shape[0] != b or seq_lens.shape != (b,):
            raise ValueError(f"batch mismatch: q {b}, block_table {block_table.shape[0]}, seq_lens {seq_lens.shape}")
        capacity = block_table.shape[1] * k_cache.shape[1]
        # flash reads the block table out of bounds past its capacity; checked where it costs no device sync
        if seq_lens.device.type == "cpu" and b and int(seq_lens.max()) > capacity:
            raise ValueError(f"seq_len {int(seq_lens.max())} exceeds block_table capacity {capacity}")
        if b == 0:
            return q.new_zeros(0, hq, d), torch.empty(hq, 0, dtype=torch.float32, device=q.device)
        lens = _int32(seq_lens, q.device)
        out, lse = self._fa.flash_attn_with_kvcache(
            q.unsqueeze(1),  # [B, 1, Hq, D]
            k_cache,
            v_cache,
            cache_seqlens=lens,
            block_table=_int32(block_table, q.device),
            softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d),
            causal=True,
            return_softmax_lse=True,
        )
        empty = lens == 0  # [B]
        out = out[:, 0].masked_fill(empty[:, None, None], 0.0)  # [B, Hq, D]
        lse = _spindle_lse(lse[:, :, 0].transpose(0, 1)).masked_fill(empty[None, :], float("-inf"))  # [Hq, B]
        return out, lse.contiguous()

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
        if q.dim() != 3:
            raise ValueError(f"q must be [tokens, heads, head_dim]; got {tuple(q.shape)}")
        self._check_paged(q, k_cache, v_cache, block_table)
        tq, hq, d = q.shape
        _, lens = _split(cu_seqlens_q, tq)
        totals = [int(x) for x in seq_lens.tolist()]
        if len(totals) != len(lens) or block_table.shape[0] != len(lens):
            raise ValueError(f"{len(lens)} chunks but {len(totals)} seq_lens / {block_table.shape[0]} block rows")
        for i, (n, total) in enumerate(zip(lens, totals, strict=True)):
            if n > total:
                raise ValueError(f"chunk of {n} tokens longer than the {total} cached for sequence {i}")
        capacity = block_table.shape[1] * k_cache.shape[1]
        if max(totals, default=0) > capacity:
            raise ValueError(f"seq_len {max(totals)} exceeds block_table capacity {capacity}")
        if tq == 0:
            return q.new_zeros(0, hq, d), torch.empty(hq, 0, dtype=torch.float32, device=q.device)
        if min(lens) == 0:
            raise Unsupported("a sequence with no queries")
        cu_k = torch.tensor([0, *itertools.accumulate(totals)], dtype=torch.int32, device=q.device)  # [B+1]
        out, lse, _ = self._fa.flash_attn_varlen_func(
            q if q.stride(-1) == 1 else q.contiguous(),
            k_cache,
            v_cache,
            _int32(cu_seqlens_q, q.device),
            cu_k,
            max(lens),
            max(totals),
            dropout_p=0.0,
            softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d),
            causal=True,  # bottom-right: each chunk ends at its sequence's last cached token
            block_table=_int32(block_table, q.device),
            return_attn_probs=True,
        )
        return out, _spindle_lse(lse)  # [Tq, Hq, D], [Hq, Tq]
