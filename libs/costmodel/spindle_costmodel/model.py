"""Llama-family model shapes: presets for the papers' models, or any HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name}: {f} must be >= 1, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: {self.heads} heads do not group over {self.kv_heads} KV heads")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Token embedding plus the LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    def with_dtype(self, dtype: str) -> ModelShape:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        return replace(self, dtype_bytes=DTYPE_BYTES[dtype])


def from_hf_config(path: str | Path, name: str | None = None) -> ModelShape:
    """A shape from a Hugging Face Llama-family `config.json` (or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a model config from {p}: {e}") from e
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return ModelShape(
            name=name or cfg.get("_name_or_path") or p.parent.name,
            layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            dtype_bytes=DTYPE_BYTES.get(dtype, 2),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{p} is not a Llama-family config: {e}") from e


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelShape("llama2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
        ModelShape("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        ModelShape("codellama-34b", 48, 8192, 64, 8, 128, 22016, 32000),
        ModelShape("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000),
        ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        # LoongServe's LWM-1M-Text: the Llama-2-7B shape with full multi-head attention
        ModelShape("lwm-1m-text", 32, 4096, 32, 32, 128, 11008, 32000),
        # CSPS's 1M-context models (§5.2): GLM-4-9B-Chat-1M (multi-query groups of 2) and InternLM2.5-7B-Chat-1M
        ModelShape("glm-4-9b-1m", 40, 4096, 32, 2, 128, 13696, 151552),
        ModelShape("internlm2.5-7b-1m", 32, 4096, 32, 8, 128, 14336, 92544),
        # the embedded default, run in fp32 on CPU
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, dtype_bytes=4, tied_embeddings=True),
    )
}


def get_model(name_or_path: str) -> ModelShape:
    """A preset by name, or a `config.json` (or its directory) path."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}; known: {', '.join(MODELS)} (or a config.json path)")
