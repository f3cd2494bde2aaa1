"""Spindle's tokenizer side without torch: tokenizer, incremental detokenizer, chat templates, model location."""

from .locate import (
    CONVERTER_VERSION,
    ModelLocation,
    default_cache_dir,
    gguf_cache_key,
    known_model_gguf,
    known_model_names,
    locate_model,
)
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "CONVERTER_VERSION",
    "IncrementalDetokenizer",
    "ModelLocation",
    "Tokenizer",
    "default_cache_dir",
    "gguf_cache_key",
    "known_model_gguf",
    "known_model_names",
    "locate_model",
]
