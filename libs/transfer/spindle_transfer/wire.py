"""What travels on the wire besides the payload: a fixed-size int64 tensor header and one-word signals.

One transfer on tag T from S to R is four messages, all on T:
  S -> R  header  int64[13]: MAGIC, VERSION, dtype code, ndim, 8 dims (zero padded), nbytes
  R -> S  verdict int64[2]:  SIGNAL_MAGIC, ACCEPT | REJECT | CANCELLED
  S -> R  payload uint8[nbytes]   (only after ACCEPT, skipped when nbytes == 0)
  S -> R  trailer int64[2]:  SIGNAL_MAGIC, COMMIT | ABORT
The verdict lets a receiver refuse a header without ever posting a payload buffer (and without leaving
the sender blocked); the trailer lets a sender that gave up mid-way still finish the exchange, so the
receiver learns that the bytes it got are not to be used.
"""

from __future__ import annotations

import torch

from spindle_protocol import TensorHeader, check_header

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES, start=1)}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

MAGIC = 0x53504E444C4B56  # "SPNDLKV"
VERSION = 1
MAX_DIMS = 8
HEADER_WORDS = 4 + MAX_DIMS + 1
SIGNAL_MAGIC = 0x53504E444C5347  # "SPNDLSG"

ACCEPT, REJECT, CANCELLED = 1, 2, 3  # verdicts
COMMIT, ABORT = 11, 12  # trailers


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not transferable; use one of {sorted(DTYPES)}") from None


def header_of(tensor: torch.Tensor) -> TensorHeader:
    name = dtype_name(tensor.dtype)
    return TensorHeader(dtype=name, shape=list(tensor.shape), nbytes=tensor.numel() * tensor.element_size())


def encode_header(header: TensorHeader, device: torch.device | str = "cpu") -> torch.Tensor:
    check_header(header)
    dims = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    words = [MAGIC, VERSION, DTYPE_CODES[header.dtype], len(header.shape), *dims, header.nbytes]
    return torch.tensor(words, dtype=torch.int64, device=device)


def decode_header(words: torch.Tensor) -> TensorHeader:
    """Parse an untrusted header tensor; raise ValueError unless it is well formed and self-consistent."""
    w = words.cpu().tolist()
    if len(w) != HEADER_WORDS or w[0] != MAGIC:
        raise ValueError("data-plane header has a bad magic number (not a Spindle transfer?)")
    if w[1] != VERSION:
        raise ValueError(f"data-plane header version {w[1]} is not {VERSION}")
    names = {code: name for name, code in DTYPE_CODES.items()}
    if w[2] not in names:
        raise ValueError(f"data-plane header has unknown dtype code {w[2]}")
    ndim = w[3]
    if not 0 < ndim <= MAX_DIMS or any(d != 0 for d in w[4 + ndim : 4 + MAX_DIMS]):
        raise ValueError(f"data-plane header has a bad rank {ndim}")
    header = TensorHeader(dtype=names[w[2]], shape=w[4 : 4 + ndim], nbytes=w[4 + MAX_DIMS])
    check_header(header)
    return header


def encode_signal(value: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([SIGNAL_MAGIC, value], dtype=torch.int64, device=device)


def decode_signal(words: torch.Tensor, allowed: tuple[int, ...]) -> int:
    magic, value = words.cpu().tolist()
    if magic != SIGNAL_MAGIC or value not in allowed:
        raise ValueError(f"bad data-plane signal {magic:#x}/{value}")
    return value
