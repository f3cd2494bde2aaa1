"""Small-batch GEMM on CPU over a packed copy of the weight (decode batches, the LM head).

torch's CPU GEMMs are tuned for large M; a decode step multiplies a few rows by every weight, so it is bound
by reading the weights. A packed weight stores `[N, K]` as tiles of 64 output columns, each one sequential
stream, and `linear()` reads each tile once per pass of several rows of x with fp32 FMAs (gemm.c):
- `PackedWeight`: float32 or bfloat16 elements (bf16 widened in registers: this CPU family's bf16 dot
  instructions run at half the fp32 FMA rate).
- `GGUFPackedWeight`: GGUF Q4_1 / Q8_0 blocks kept quantized (0.625 / 1.06 bytes per weight instead of 4).
  Each weight is rebuilt in registers exactly as GGUF's dequantization computes it, so the product equals
  `PackedWeight` over the dequantized float32 weight bit for bit, at a sixth of the bytes read.
Each output row is computed the same way whatever the batch size, so a request's decode does not depend on
what it is batched with (up to `MAX_ROWS`, beyond which callers use torch's GEMM).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .native import kernels

MAX_ROWS = 32  # the kernel beats torch's GEMM here up to about this many rows
DTYPES = (torch.float32, torch.bfloat16)
FMT_F32, FMT_BF16, FMT_Q4_1, FMT_Q8_0 = 0, 1, 2, 3
GGUF_BLOCK = 32  # weights per GGUF block along K
GGUF_FORMATS = {"Q4_1": (FMT_Q4_1, 20, 1280), "Q8_0": (FMT_Q8_0, 34, 2176)}  # fmt, block bytes, tile bytes
_TILE = 64


class _Packed:
    """What every packed weight has: its shape, kernel format code and packed bytes."""

    out_features: int
    in_features: int
    fmt: int
    data: Tensor

    def linear(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`x [M, K] @ weight.T` -> `[M, N]` in `out_dtype` (default x's dtype; float32 or bfloat16)."""
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"x has {k} features, the weight {self.in_features}")
        out_dtype = out_dtype or x.dtype
        assert out_dtype in DTYPES
        xf = x.to(torch.float32).contiguous()
        y = torch.empty(m, self.out_features, dtype=out_dtype)
        kernels().spindle_gemm_packed(
            xf.data_ptr(), self.data.data_ptr(), y.data_ptr(), m, self.out_features, k, self.fmt,
            int(out_dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        return y


class PackedWeight(_Packed):
    def __init__(self, weight: Tensor) -> None:
        lib = kernels()
        if lib is None:
            raise RuntimeError("CPU kernels are not available")
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in DTYPES:
            raise ValueError(f"expected a 2-D float32/bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.fmt = FMT_F32 if w.dtype == torch.float32 else FMT_BF16
        tiles = -(-self.out_features // _TILE)
        self.data = torch.empty(tiles * self.in_features * _TILE, dtype=w.dtype)  # [N/64, K, 64]
        n, k = self.out_features, self.in_features
        lib.spindle_pack_weight(w.data_ptr(), self.data.data_ptr(), n, k, w.element_size())


class GGUFPackedWeight(_Packed):
    """A GGUF-quantized weight: `raw` uint8 `[N, K / 32 * block_bytes]`, the tensor's rows as stored in the file
    (rows may be reordered or sliced beforehand; K stays whole)."""

    def __init__(self, raw: np.ndarray | Tensor, kind: str, in_features: int) -> None:
        lib = kernels()
        if lib is None:
            raise RuntimeError("CPU kernels are not available")
        if kind not in GGUF_FORMATS:
            raise ValueError(f"GGUF type {kind} has no CPU kernel (supported: {', '.join(GGUF_FORMATS)})")
        self.fmt, block_bytes, tile_bytes = GGUF_FORMATS[kind]
        self.kind = kind
        raw_t = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw.contiguous()
        if in_features % GGUF_BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of the GGUF block ({GGUF_BLOCK})")
        row_bytes = in_features // GGUF_BLOCK * block_bytes
        if raw_t.dtype != torch.uint8 or raw_t.dim() != 2 or raw_t.shape[1] != row_bytes:
            raise ValueError(
                f"expected uint8 [rows, {row_bytes}] {kind} blocks, got {raw_t.dtype} {tuple(raw_t.shape)}"
            )
        self.out_features, self.in_features = raw_t.shape[0], in_features
        tiles = -(-self.out_features // _TILE)
        self.data = torch.empty(tiles * (in_features // GGUF_BLOCK) * tile_bytes, dtype=torch.uint8)
        lib.spindle_pack_gguf(raw_t.data_ptr(), self.data.data_ptr(), self.out_features, in_features, self.fmt)
