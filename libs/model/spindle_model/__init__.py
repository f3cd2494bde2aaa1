"""Llama-family model for Spindle: config, layers, tensor/pipeline-parallel shards, loaders, tokenizer."""

from .config import ModelConfig, RopeScaling
from .llama import AttentionContext, CausalAttention, LlamaModel
from .parallel import TPShard, shard_range

__all__ = [
    "AttentionContext",
    "CausalAttention",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "TPShard",
    "shard_range",
]
