"""CPU kernels (AVX-512, built on first use): small-batch GEMM over packed (also GGUF-quantized) weights, paged
decode attention, causal prefill attention of a chunk (`prefill`), a whole Llama decode step in one call
(`llama_decode`), and one-pass RMSNorm and SiLU * up for prefill steps (`elementwise`).
"""

from . import decode, elementwise, gemm, prefill
from .decode import DecodeBatch
from .gemm import MAX_ROWS, GGUFPackedWeight, PackedWeight
from .native import kernels


def available() -> bool:
    return kernels() is not None


__all__ = [
    "MAX_ROWS",
    "DecodeBatch",
    "GGUFPackedWeight",
    "PackedWeight",
    "available",
    "decode",
    "elementwise",
    "gemm",
    "kernels",
    "prefill",
]  # fmt: skip
