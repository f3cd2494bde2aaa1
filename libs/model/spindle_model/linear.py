"""Linear layers without bias, with faster CPU paths.

- Few rows (decode batches, up to `cpu.MAX_ROWS`): Spindle's packed small-batch GEMM
  (`spindle_attention.cpu.PackedWeight`), bound by reading the weight once; packed lazily on the first such
  call, so instances that only prefill never hold the copy. A model loaded from GGUF may instead hand it the
  file's quantized blocks (`use()`, see `gguf_blocks.py`): the same products from a sixth of the bytes.
- Many rows in bfloat16: oneDNN's prepacked GEMM (the kernel torch's inductor uses for frozen weights), which
  uses the CPU's bf16 dot-product instructions. For float32, `F.linear` (MKL) was faster end to end.
The plain weight is kept for loading, sharding and the large-batch path; on CUDA it is the only path
(`pack()` and the small-batch kernels turn themselves off for non-CPU weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spindle_attention import cpu

_mkldnn = getattr(torch.ops, "mkldnn", None)
_HAS_PACKED = (
    torch.backends.mkldnn.is_available()
    and hasattr(_mkldnn, "_reorder_linear_weight")
    and hasattr(_mkldnn, "_linear_pointwise")
)


class SmallBatchWeight:
    """A weight's packed copy for few-row products, made on first use (None where the kernels are off)."""

    def __init__(self) -> None:
        self._packed: cpu.PackedWeight | cpu.GGUFPackedWeight | None = None
        self._off = False

    def reset(self) -> None:
        self._packed, self._off = None, False

    def use(self, packed: cpu.GGUFPackedWeight) -> None:
        """Serve small batches from `packed` (the same weight in another storage format)."""
        self._packed, self._off = packed, False

    def packed(self, weight: Tensor) -> cpu.PackedWeight | cpu.GGUFPackedWeight | None:
        """The packed copy (made now if needed), or None where the kernels cannot take this weight."""
        if self._packed is None and not self._off:
            if not cpu.available() or weight.device.type != "cpu" or weight.dtype not in cpu.gemm.DTYPES:
                self._off = True
            else:
                self._packed = cpu.PackedWeight(weight)
        return self._packed

    def linear(self, x: Tensor, weight: Tensor, out_dtype: torch.dtype | None = None) -> Tensor | None:
        """`x @ weight.T` by the packed kernel, or None when it does not apply (caller uses torch)."""
        if self._off or x.dim() != 2 or x.shape[0] > cpu.MAX_ROWS or x.device.type != "cpu":
            return None
        packed = self.packed(weight)
        return None if packed is None else packed.linear(x, out_dtype)


class Linear(nn.Module):
    """`y = x @ weight.T` with weight `[out_features, in_features]`; call `pack()` after loading weights."""

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self._packed: Tensor | None = None
        self.small = SmallBatchWeight()

    def pack(self) -> None:
        """Prepare the fast paths for the loaded weight (oneDNN copy for CPU bfloat16; small-batch on demand)."""
        self._packed = None
        self.small.reset()
        if _HAS_PACKED and self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16:
            self._packed = _mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: Tensor) -> Tensor:
        if (y := self.small.linear(x, self.weight)) is not None:
            return y
        if self._packed is not None and x.dim() == 2 and x.device.type == "cpu":
            return _mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return F.linear(x, self.weight)
