"""Spindle's attention implementations behind one registry, chosen per device.

Four backends share one interface (`AttentionBackend`: `attention_fwd` with LSE, `paged_decode`,
`paged_prefill`, with the reference's semantics):

- `reference`: the torch implementations at the package top level; runs anywhere, the oracle and last fallback.
- `cpu`: Spindle's native CPU kernels (`spindle_attention.cpu`), where they are built.
- `triton`: `spindle_attention.triton`, on CUDA (or on CPU under `TRITON_INTERPRET=1`).
- `flash-attn`: the `flash_attn` package (`spindle-attention[gpu]`), on Ampere or newer GPUs.

`select_backend("cuda")` picks flash-attn, else triton, else the reference; `select_backend("cpu")` the native
kernels, else the reference; a backend asked for by name that cannot run raises ValueError (see `registry`).
Calls a backend cannot express run on its fallback (see `base`).
"""

from . import flash, native_cpu, reference, triton  # noqa: F401  (importing a backend registers it)
from .base import AttentionBackend, FwdArgs, Unsupported
from .registry import (
    AUTO,
    available_backends,
    backend_names,
    get_backend,
    parse_device,
    preference,
    register_backend,
    select_backend,
)

__all__ = [
    "AUTO",
    "AttentionBackend",
    "FwdArgs",
    "Unsupported",
    "available_backends",
    "backend_names",
    "get_backend",
    "parse_device",
    "preference",
    "register_backend",
    "select_backend",
]
