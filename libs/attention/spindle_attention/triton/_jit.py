"""Deferred `triton.jit` and the checks every kernel wrapper shares.

Kernels are plain functions marked `@lazy_jit`. On the first launch of a kernel, triton is imported, the
kernel's module gets `tl` (triton.language) bound, and every `@lazy_jit` function of that module goes through
`triton.jit`. So importing `spindle_attention.triton` never imports triton.

`TRITON_INTERPRET=1` must be set before triton itself is imported (triton jits its own library functions, such
as `tl.sum`, at import), which with this package means before the first kernel launch unless something else
imported triton earlier; a mismatch is reported as a RuntimeError instead of a failure deep in a kernel.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

LOG2E = 1.4426950408889634
_MISSING = "spindle_attention.triton kernels need the `triton` package; install spindle-attention[triton]"


def available() -> bool:
    """True when triton is importable (kernels can then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    if "triton" in sys.modules:
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None


def _triton() -> ModuleType:
    """Import triton (on the first launch), checking that its interpreter setting is the one in force now."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        raise RuntimeError(_MISSING) from e
    stdlib_compiled = isinstance(tl.sum, JITFunction)  # triton's own jit functions follow the setting at import
    if triton.knobs.runtime.interpret and stdlib_compiled:
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set, but triton was imported before it was; set it before anything imports "
            "triton (in the environment or a conftest.py)"
        )
    if not triton.knobs.runtime.interpret and not stdlib_compiled:
        raise RuntimeError("triton was imported under TRITON_INTERPRET=1, which is no longer set")
    return triton


def interpreting() -> bool:
    """True when kernels run under the triton interpreter (TRITON_INTERPRET=1)."""
    return bool(_triton().knobs.runtime.interpret)


class LazyKernel:
    """A kernel (or device helper) that becomes a `triton.jit` function on its first launch.

    Materialising one kernel binds `tl` in its module, materialises every `LazyKernel` bound there and rebinds
    those module globals, so a jitted kernel resolves `tl` and its helpers to the real things.
    """

    def __init__(self, fn: Callable[..., Any], jit_kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self.jitted: Any = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def materialize(self) -> Any:
        if self.jitted is None:
            triton = _triton()
            module_globals = self.fn.__globals__
            module_globals["tl"] = triton.language
            for name, value in list(module_globals.items()):
                if isinstance(value, LazyKernel) and value.jitted is None:
                    value.jitted = triton.jit(value.fn, **value.jit_kwargs)
                    module_globals[name] = value.jitted
        return self.jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.materialize()[grid]


def lazy_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """`@lazy_jit` / `@lazy_jit(do_not_specialize=[...])`: defer `triton.jit(fn, **jit_kwargs)` to first launch."""
    if fn is None:
        return lambda f: LazyKernel(f, jit_kwargs)
    return LazyKernel(fn, jit_kwargs)


def check_device(*tensors: Tensor) -> None:
    """Raise a RuntimeError when the kernels cannot run on these tensors' device."""
    interpret = interpreting()  # imports triton: RuntimeError when it is missing
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop()
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret:
        return
    raise RuntimeError(
        f"Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; got device {device}"
    )


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def head_dim_pad(d: int) -> int:
    """The power-of-two tile width (at least 16, so `tl.dot` can use it) that holds head_dim `d`."""
    return max(16, next_pow2(d))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (ieee) products rather than tf32, so fp32 results match the reference tightly."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
