"""Llama building blocks: RMSNorm and rotary position embedding (incl. Llama-3 scaling)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and scale in the model dtype, as the reference implementation does.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies `[head_dim // 2]` fp32, with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_between, between, scaled)


class RotaryEmbedding(nn.Module):
    """Half-split (rotate_half) RoPE. cos/sin are tabulated up to the model's context and computed beyond."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("table", self._cos_sin(torch.arange(config.max_position_embeddings)), persistent=False)

    def _cos_sin(self, positions: Tensor) -> Tensor:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        return torch.stack([freqs.cos(), freqs.sin()])  # [2, T, D/2]

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.numel() and int(positions.max()) >= self.table.shape[1]:
            cs = self._cos_sin(positions)
        else:
            cs = self.table[:, positions]
        return cs[0].unsqueeze(1), cs[1].unsqueeze(1)  # each [T, 1, D/2]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[T, heads, D]`; cos/sin `[T, 1, D/2]` fp32. Rotation computed in fp32, returned in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
