"""Tokenizer wrapper over transformers' AutoTokenizer, plus streaming (incremental) detokenization."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


class Tokenizer:
    """The tokenizer of a model directory (tokenizer.json / tokenizer_config.json, loaded from local files only)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {self.path}: {e}") from e
        config = _read_json(self.path / "config.json")
        generation = _read_json(self.path / "generation_config.json")

        eos: list[int] = _eos_ids(self._tok.eos_token_id)
        eos += _eos_ids(config.get("eos_token_id")) + _eos_ids(generation.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        bos = self._tok.bos_token_id
        if bos is None:
            bos = config.get("bos_token_id", generation.get("bos_token_id"))
        self.bos_token_id: int | None = None if bos is None else int(bos)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model may pad its embedding)."""
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No tokenization-space cleanup: decoding stays a pure function of the tokens' bytes, which is what makes
        # incremental detokenization add up to the same text.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text, rendered with the model's chat template."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        from jinja2 import TemplateError

        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as e:  # templates reject e.g. unsupported roles with raise_exception
            raise ValueError(f"chat template rejected the messages: {e}") from e
        assert isinstance(text, str)
        return text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt. The template writes special tokens (and BOS) itself."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, emitting only completed characters.

    Each step decodes a short window of recent tokens twice (with and without the new ones) and emits the
    difference, so tokenizers whose pieces depend on their neighbours (leading-space handling) decode correctly.
    Text ending in U+FFFD is held back: the last token may have ended inside a UTF-8 sequence that the next tokens
    complete. `flush()` returns whatever is still held, so that all pieces joined equal `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this have been emitted

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _pending(self) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(text) <= len(prefix):
            return ""
        return text[len(prefix) :]

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        piece = self._pending()
        if not piece or piece.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return piece

    def extend(self, token_ids: Iterable[int]) -> str:
        """Feed several tokens; return the newly completed text."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Return the held-back remainder (an incomplete UTF-8 tail decodes to U+FFFD, as in `decode`)."""
        piece = self._pending()
        self._prefix_offset = self._read_offset = len(self._ids)
        return piece
