"""CPU kernels (AVX-512, built on first use): small-batch GEMM over packed (also GGUF-quantized) weights, paged
decode attention, a whole Llama decode step in one call (`llama_decode`), and one-pass RMSNorm and SiLU * up
for prefill steps (`elementwise`).

`available()` says whether they loaded; every caller keeps its torch path for when they did not.
"""

from . import decode, elementwise, gemm
from .decode import DecodeBatch
from .gemm import MAX_ROWS, GGUFPackedWeight, PackedWeight
from .native import kernels


def available() -> bool:
    return kernels() is not None


__all__ = [
    "MAX_ROWS", "DecodeBatch", "GGUFPackedWeight", "PackedWeight", "available", "decode", "elementwise", "gemm",
    "kernels",
]  # fmt: skip
