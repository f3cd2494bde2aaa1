"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"  # a known name, an HF Llama directory, or a .gguf file
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_tokens: int | None = None  # KV capacity in tokens; default from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0  # for requests that carry no seed of their own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_tokens(self, bytes_per_token: int) -> int:
        """KV capacity in tokens: `kv_cache_tokens`, or what fits into `kv_cache_memory_gb`."""
        return self.kv_cache_tokens or int(self.kv_cache_memory_gb * 2**30 // bytes_per_token)
