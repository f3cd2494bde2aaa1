"""What every attention backend implements: the three ops Spindle's engine runs, under one contract.

- `attention_fwd`: varlen prefill (and ring steps) with LSE, the semantics of
  `spindle_attention.reference.attention_fwd`: positional causal masking, query i sees key j iff
  `k_pos[j] <= q_pos[i]`, positions `offset + index * stride` or explicit tensors.
- `paged_decode` / `paged_prefill`: attention over the paged KV cache `[num_blocks, block_size, Hkv, D]`, the
  semantics of `spindle_attention.paged`.

Each returns `(out, lse)`: out in q's dtype, lse natural-log fp32 `[Hq, tokens]`, `(0, -inf)` for a query that
sees no key. A backend whose kernels cannot express a call raises `Unsupported` before launching anything; the
public op then runs the call on the backend's `fallback` (set by `select_backend`: the next usable backend for
the device, the reference last) and logs that once per reason.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

log = logging.getLogger("spindle.attention")


class Unsupported(NotImplementedError):
    """A backend's kernels cannot express this call (raised before anything is launched); its message is the
    reason, free of shapes, so that it is logged once."""


@dataclass(frozen=True, eq=False)
class FwdArgs:
    """`attention_fwd`'s masking and batching arguments, as `spindle_attention.reference.attention_fwd` takes
    them: offsets are ints or per-sequence `[B]` tensors, cu_seqlens int `[B+1]`, positions int `[T]`."""

    causal: bool = True
    q_offset: int | Tensor = 0
    k_offset: int | Tensor = 0
    q_stride: int = 1
    k_stride: int = 1
    q_positions: Tensor | None = None
    k_positions: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        if self.q_stride < 1 or self.k_stride < 1:
            raise ValueError(f"strides must be >= 1, got q_stride={self.q_stride}, k_stride={self.k_stride}")
        if (self.cu_seqlens_q is None) != (self.cu_seqlens_k is None):
            raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")

    def kwargs(self) -> dict[str, Any]:
        """The arguments as keywords of `attention_fwd`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class AttentionBackend(ABC):
    """One implementation of the three ops, bound to a device; `fallback` runs what it cannot express."""

    name: ClassVar[str] = ""  # set by `register_backend`

    def __init__(self, device: torch.device, fallback: AttentionBackend | None = None) -> None:
        self.device = device
        self.fallback = fallback
        self._noted: set[tuple[str, str]] = set()  # (op, reason) already logged

    def __repr__(self) -> str:
        tail = f", fallback={self.fallback.name!r}" if self.fallback is not None else ""
        return f"{type(self).__name__}({self.name!r} on {self.device}{tail})"

    @classmethod
    @abstractmethod
    def unavailable(cls, device: torch.device, block_size: int | None) -> str | None:
        """Why this backend cannot serve `device` (with a paged cache of `block_size` tokens per block, when
        known), or None when it can. Never imports an optional package that is not installed."""

    # --- the ops ------------------------------------------------------------------------------------------

    def attention_fwd(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        q_offset: int | Tensor = 0,
        k_offset: int | Tensor = 0,
        q_stride: int = 1,
        k_stride: int = 1,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_k: Tensor | None = None,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]` -> out `[Tq, Hq, D]`, lse `[Hq, Tq]` fp32 (see the module doc)."""
        args = FwdArgs(
            causal=causal,
            q_offset=q_offset,
            k_offset=k_offset,
            q_stride=q_stride,
            k_stride=k_stride,
            q_positions=q_positions,
            k_positions=k_positions,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            softmax_scale=softmax_scale,
        )
        try:
            return self._attention_fwd(q, k, v, args)
        except Unsupported as e:
            return self._fallback_for("attention_fwd", e).attention_fwd(q, k, v, **args.kwargs())

    def paged_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        *,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q `[B, Hq, D]`, one token per sequence over its `seq_lens[b]` cached tokens -> out `[B, Hq, D]`,
        lse `[Hq, B]`."""
        try:
            return self._paged_decode(q, k_cache, v_cache, block_table, seq_lens, softmax_scale)
        except Unsupported as e:
            fallback = self._fallback_for("paged_decode", e)
            return fallback.paged_decode(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale)

    def paged_prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        cu_seqlens_q: Tensor,
        *,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q `[Tq, Hq, D]` packs B chunks, each the last tokens of its `seq_lens[b]` cached ones -> out
        `[Tq, Hq, D]`, lse `[Hq, Tq]`."""
        try:
            return self._paged_prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, softmax_scale)
        except Unsupported as e:
            fallback = self._fallback_for("paged_prefill", e)
            return fallback.paged_prefill(
                q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, softmax_scale=softmax_scale
            )

    # --- what each backend implements ---------------------------------------------------------------------

    @abstractmethod
    def _attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]: ...

    @abstractmethod
    def _paged_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]: ...

    @abstractmethod
    def _paged_prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        cu_seqlens_q: Tensor,
        softmax_scale: float | None,
    ) -> tuple[Tensor, Tensor]: ...

    def _fallback_for(self, op: str, error: Unsupported) -> AttentionBackend:
        if self.fallback is None:
            raise error
        key = (op, str(error))
        if key not in self._noted:
            self._noted.add(key)
            log.info(
                "attention backend %r cannot run %s with %s; those calls run on %r",
                self.name,
                op,
                error,
                self.fallback.name,
            )
        return self.fallback
