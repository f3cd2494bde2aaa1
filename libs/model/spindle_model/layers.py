"""Llama building blocks: RMSNorm and rotary position embedding (incl. Llama-3 scaling)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spindle_attention import cpu

from .config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            fused = cpu.elementwise.rms_norm(x, self.weight, self.eps)  # one pass on CPU (None elsewhere)
            return fused if fused is not None else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
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
    """RoPE on interleaved pairs: dims (2i, 2i+1) of a head rotate together, as one complex multiply.

    Hugging Face checkpoints rotate half-split pairs (i, i + D/2); `interleave_rows` reorders the q/k
    projection rows at load time so the two agree (attention scores are unchanged by a permutation applied
    to both q and k). On CPU the factors are tabulated up to the model's context and computed beyond it; on
    other devices they are always computed, so a step never reads the largest position back to the host (no
    sync, and the computation can be captured in a CUDA graph).
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        on_cpu = torch.device(device or "cpu").type == "cpu"
        table = self._factors(torch.arange(config.max_position_embeddings, device=device)) if on_cpu else None
        self.register_buffer("table", table, persistent=False)

    def _factors(self, positions: Tensor) -> Tensor:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        return torch.polar(torch.ones_like(freqs), freqs)  # [T, D/2] complex64: cos + i sin

    def factors(self, positions: Tensor) -> Tensor:
        """Rotation factors for `positions` `[T]` (on the host or the model's device): `[T, 1, D/2]` complex64."""
        if self.table is None or positions.device.type != "cpu":  # plans hand SP/PP ranks host positions
            return self._factors(positions.to(self.inv_freq.device)).unsqueeze(1)
        if positions.numel() and int(positions.max()) >= self.table.shape[0]:
            return self._factors(positions).unsqueeze(1)
        return self.table[positions].unsqueeze(1)


def interleave_rows(w: Tensor, num_heads: int) -> Tensor:
    """Reorder each head's rows of a q/k projection from half-split to interleaved rotary pairs."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def apply_rope(x: Tensor, factors: Tensor) -> Tensor:
    """x `[T, heads, D]` (interleaved pairs); factors `[T, 1, D/2]` complex64. Returns x's dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, heads, D/2]
    return torch.view_as_real(pairs * factors).flatten(-2).to(x.dtype)
