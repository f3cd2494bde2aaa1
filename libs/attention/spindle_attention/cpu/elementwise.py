"""One-pass RMSNorm and SiLU(gate) * up on CPU (elementwise.c), for the row counts of a prefill step.

Each returns None when the kernels are not available or the input is not a contiguous fp32 CPU tensor; the
caller then runs its torch path. The results agree with torch's within fp32 rounding (the sum of squares and the
sigmoid are computed in another order / by a polynomial with relative error < 1e-7).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .native import kernels


def _usable(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """`x [T, H] / sqrt(mean(x^2, -1) + eps) * weight [H]`, or None (use torch)."""
    lib = kernels()
    if lib is None or x.dim() != 2 or weight.shape != (x.shape[1],) or not _usable(x, weight):
        return None
    y = torch.empty_like(x)
    lib.spindle_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps,
                         torch.get_num_threads())  # fmt: skip
    return y


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """`silu(g) * u` for `gate_up [T, 2F] = [g | u]` -> `[T, F]`, or None (use torch)."""
    lib = kernels()
    if lib is None or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _usable(gate_up):
        return None
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(t, f, dtype=torch.float32)
    lib.spindle_silu_mul(gate_up.data_ptr(), act.data_ptr(), t, f, torch.get_num_threads())
    return act
