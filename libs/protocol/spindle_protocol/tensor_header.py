"""Tensor headers for the data plane: a receiver checks dtype, shape and size before trusting a buffer."""

from __future__ import annotations

import math

from .messages import TensorHeader

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}
MAX_TENSOR_BYTES = 64 * 2**30


def header_for(dtype: str, shape: list[int] | tuple[int, ...]) -> TensorHeader:
    shape = [int(s) for s in shape]
    header = TensorHeader(dtype=dtype, shape=shape, nbytes=math.prod(shape) * DTYPE_SIZES.get(dtype, 0))
    check_header(header)
    return header


def check_header(header: TensorHeader, expect: TensorHeader | None = None, max_bytes: int = MAX_TENSOR_BYTES) -> None:
    """Raise ValueError unless the header is self-consistent, within `max_bytes` and equal to `expect`."""
    if header.dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor dtype {header.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if not 0 < len(header.shape) <= 8 or any(not isinstance(s, int) or s < 0 for s in header.shape):
        raise ValueError(f"tensor shape {header.shape} must have 1-8 non-negative dimensions")
    nbytes = math.prod(header.shape) * DTYPE_SIZES[header.dtype]
    if nbytes != header.nbytes:
        raise ValueError(f"tensor header says {header.nbytes} bytes but {header.dtype}{header.shape} is {nbytes}")
    if nbytes > max_bytes:
        raise ValueError(f"tensor of {nbytes} bytes exceeds the limit of {max_bytes}")
    if expect is not None and header != expect:
        raise ValueError(f"tensor header {header} does not match the expected {expect}")
