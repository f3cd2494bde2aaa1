"""Small-batch GEMM on CPU over a packed copy of the weight (decode batches, the LM head).

torch's CPU GEMMs are tuned for large M; a decode step multiplies a few rows by every weight, so it is bound
by reading the weights. `PackedWeight` stores `[N, K]` as `[N/64][K][64]` tiles, each one sequential stream,
and `linear()` reads each tile once per 6 rows of x with fp32 FMAs (bf16 weights are widened in registers:
this CPU family's bf16 dot instructions run at half the fp32 FMA rate). Each output row is computed the same
way whatever the batch size, so a request's decode does not depend on what it is batched with (up to
`MAX_ROWS`, beyond which callers use torch's GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .native import kernels

MAX_ROWS = 32  # the kernel beats torch's GEMM here up to about this many rows
DTYPES = (torch.float32, torch.bfloat16)


class PackedWeight:
    def __init__(self, weight: Tensor) -> None:
        lib = kernels()
        if lib is None:
            raise RuntimeError("CPU kernels are not available")
        self.lib = lib
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in DTYPES:
            raise ValueError(f"expected a 2-D float32/bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        tiles = -(-self.out_features // 64)
        self.data = torch.empty(tiles * self.in_features * 64, dtype=w.dtype)  # [N/64, K, 64]
        n, k = self.out_features, self.in_features
        lib.spindle_pack_weight(w.data_ptr(), self.data.data_ptr(), n, k, w.element_size())

    def linear(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`x [M, K] @ weight.T` -> `[M, N]` in `out_dtype` (default x's dtype; float32 or bfloat16)."""
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"x has {k} features, the weight {self.in_features}")
        out_dtype = out_dtype or x.dtype
        assert out_dtype in DTYPES
        xf = x.to(torch.float32).contiguous()
        y = torch.empty(m, self.out_features, dtype=out_dtype)
        self.lib.spindle_gemm_packed(
            xf.data_ptr(), self.data.data_ptr(), y.data_ptr(), m, self.out_features, k, self.data.element_size(),
            int(out_dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        return y
