"""What the gateway reads of the model: its tokenizer and two numbers of its config.json, without torch.

A GGUF model not converted yet (the gateway started on its own, not by `spindle up`, which converts first) is
converted here by spindle_model, imported only then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spindle_tokenizer import Tokenizer, locate_model

log = logging.getLogger("spindle.gateway")


@dataclass(frozen=True)
class ModelFiles:
    tokenizer: Tokenizer
    max_position_embeddings: int  # the model's context length
    vocab_size: int  # token ids a prompt may hold: the model's embedding rows or the tokenizer's ids, the larger


def load_model_files(model: str) -> ModelFiles:
    """The tokenizer and limits of a model name or path (ValueError when it cannot be found or read)."""
    location = locate_model(model)
    if not location.ready:
        log.warning(
            "%s is not converted yet: converting it into %s here (this loads torch; `spindle up` converts before "
            "it starts the services)",
            location.gguf,
            location.path,
        )
        try:
            from spindle_model import resolve_model
        except ImportError as e:
            raise ValueError(
                f"{location.gguf} has not been converted and spindle-model is not installed to convert it: run "
                f"`spindle up`, or resolve the model once where spindle-model is installed ({e})"
            ) from e
        resolve_model(model)
    tokenizer = Tokenizer(location.path)
    config = location.config()
    try:
        max_len = int(config.get("max_position_embeddings", 2048))  # spindle_model.ModelConfig's default
        vocab_size = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cannot read the model's limits from {location.path / 'config.json'}: {e!r}") from e
    return ModelFiles(tokenizer, max_len, max(vocab_size, tokenizer.vocab_size))
