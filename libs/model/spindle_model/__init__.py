"""Llama-family model for Spindle: config, layers, tensor/pipeline-parallel shards, loaders, tokenizer.

The tokenizer lives in spindle_tokenizer (no torch), re-exported here.
"""

from spindle_tokenizer import IncrementalDetokenizer, Tokenizer

from .config import ModelConfig, RopeScaling
from .gguf_blocks import attach_gguf_blocks
from .gguf_convert import convert_gguf
from .llama import AttentionContext, CausalAttention, LlamaModel
from .parallel import TPShard, shard_range
from .sources import ModelSource, resolve_model
from .weights import load_state_dict

__all__ = [
    "AttentionContext",
    "CausalAttention",
    "IncrementalDetokenizer",
    "LlamaModel",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "TPShard",
    "Tokenizer",
    "attach_gguf_blocks",
    "convert_gguf",
    "load_state_dict",
    "resolve_model",
    "shard_range",
]
