"""The engine's attention context on flash-attn (FlashAttention-2): `FlashPagedAttentionContext`.

Like the Triton context, a layer makes three calls at most, with every index tensor built once per step (int32,
on the device, copied without blocking) and every maximum length known on the host, so the layer loop never
syncs with the host:

- decodes: the `flash-attn` backend's `paged_decode` (`spindle_attention.backends.flash`), which is
  `flash_attn_with_kvcache` over the paged cache with the adapter's layout conversions;
- chunks with no history: `flash_attn_varlen_func` over this step's contiguous K/V;
- chunks continuing a cached history: `flash_attn_varlen_func` reading the paged cache through a block table.

These two are called here rather than through the adapter's `attention_fwd` / `paged_prefill`, which read their
sequence lengths back to the host on every call. flash-attn's causal mask is aligned to the bottom-right corner,
which is where every chunk sits: at the end of its sequence's keys.

Spindle rotates q and k in the model (RoPE) before attention and the cache holds rotated keys: flash-attn is
never given rotary tables (nor new K/V to append), so it rotates nothing and writes nothing into the cache.
What flash-attn cannot run is refused when the engine is built (`unsupported_reason`; the device, the dtype and
the block size by `EngineConfig`), so the adapter has no fallback here. CUDA graphs capture only the Triton
context (cuda_graphs.graph_mode): flash-attn steps run eagerly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from spindle_attention.backends import get_backend
from spindle_attention.backends.flash import DTYPES, MAX_HEAD_DIM, PAGE_MULTIPLE

from .attention import PrefillChunk, ThreeCallContext, host_to_device
from .kv_cache import KVCache


def unsupported_reason(head_dim: int, dtype: torch.dtype, block_size: int) -> str | None:
    """Why flash-attn cannot run a model of `head_dim` in `dtype` over blocks of `block_size`, or None."""
    if dtype not in DTYPES:
        return f"flash-attn runs float16 and bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"flash-attn takes a head_dim that is a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
    if block_size % PAGE_MULTIPLE:
        return f"flash-attn's paged KV cache needs a block size that is a multiple of {PAGE_MULTIPLE}, not {block_size}"
    return None


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class _Varlen:
    """Chunks run in one `flash_attn_varlen_func` call: their span of the flat batch and flash's metadata."""

    start: int
    end: int
    cu_q: Tensor  # [B+1] int32: chunk offsets relative to `start`
    cu_k: Tensor  # [B+1] int32: cumulative keys (the chunk itself, or its sequence's cached tokens with it)
    max_q: int
    max_k: int
    block_table: Tensor | None  # [B, max_blocks] int32 when the keys are read from the paged cache


def _varlen(chunks: list[PrefillChunk], paged: bool, device: torch.device) -> _Varlen | None:
    if not chunks:
        return None
    start = chunks[0].start
    keys = [c.history + c.length if paged else c.length for c in chunks]
    cu_q, cu_k = [0], [0]
    for c, n in zip(chunks, keys, strict=True):
        assert c.start == start + cu_q[-1], "a call's chunks must be adjacent in the flat batch"
        cu_q.append(cu_q[-1] + c.length)
        cu_k.append(cu_k[-1] + n)
    table = None
    if paged:
        width = max(len(c.block_table) for c in chunks)
        table = host_to_device(
            [c.block_table + [0] * (width - len(c.block_table)) for c in chunks], torch.int32, device
        )
    return _Varlen(
        start=start,
        end=start + cu_q[-1],
        cu_q=host_to_device(cu_q, torch.int32, device),
        cu_k=host_to_device(cu_k, torch.int32, device),
        max_q=max(c.length for c in chunks),
        max_k=max(keys),
        block_table=table,
    )


class FlashPagedAttentionContext(ThreeCallContext):
    """Backend "flash-attn": flash-attn's KV-cache and varlen kernels, three calls per layer at most."""

    def __init__(
        self,
        cache: KVCache,
        first_layer: int,
        slot_mapping: Tensor,
        num_decodes: int,
        decode_block_table: Tensor,
        decode_seq_lens: Tensor,
        prefills: list[PrefillChunk],
        *,
        decode_max_len: int,
    ) -> None:
        device = cache.k.device
        assert decode_block_table.dtype == torch.int32 and decode_seq_lens.dtype == torch.int32
        # flash reads past a block table's end without a check of its own
        assert decode_max_len <= decode_block_table.shape[1] * cache.block_size
        self.backend = get_backend("flash-attn")(device)  # no fallback: the engine refused what it cannot run
        self.flash = importlib.import_module("flash_attn")
        self.cache = cache
        self.first_layer = first_layer
        self.slot_mapping = slot_mapping  # [T] flat cache slot of every token in the batch
        self.num_decodes = num_decodes
        self.decode_block_table = decode_block_table  # [num_decodes, max_blocks] int32, on the device
        self.decode_seq_lens = decode_seq_lens  # [num_decodes] int32 on the device, including the new token
        self.fresh = _varlen([c for c in prefills if c.history == 0], False, device)
        self.continued = _varlen([c for c in prefills if c.history > 0], True, device)

    def _chunks(self, g: _Varlen, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, scale: float) -> None:  # type: ignore[override]
        if g.block_table is None:
            keys, values = _last_dim_contiguous(keys), _last_dim_contiguous(values)
        out.copy_(
            self.flash.flash_attn_varlen_func(
                _last_dim_contiguous(q),
                keys,
                values,
                g.cu_q,
                g.cu_k,
                g.max_q,
                g.max_k,
                dropout_p=0.0,
                softmax_scale=scale,
                causal=True,  # bottom-right: each chunk ends at its sequence's last key
                block_table=g.block_table,
            )
        )

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.backend.paged_decode(q, k_cache, v_cache, self.decode_block_table, self.decode_seq_lens)[0]
