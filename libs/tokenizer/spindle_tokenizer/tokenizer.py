"""A model directory's tokenizer on the `tokenizers` library (no torch, no transformers), plus streaming
(incremental) detokenization.

It reads what Hugging Face `transformers` reads for a fast tokenizer and gives the same ids and text:
tokenizer.json (the whole pipeline, post-processor included: like transformers >= 5, `add_bos_token` /
`add_eos_token` in tokenizer_config.json do not override it), tokenizer_config.json (named special tokens, the
chat template unless chat_template.jinja has it), config.json and generation_config.json (more end-of-sequence
ids, the BOS id when the tokenizer names none, and the model's generation defaults). transformers' model-specific
tokenizer classes (LlamaTokenizer, ...) rebuild parts of the pipeline in Python; this one takes tokenizer.json as
written, which is what those rebuilds aim to reproduce.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from . import chat_template
from .locate import read_json

_REPLACEMENT_CHAR = "\ufffd"
# generation_config.json keys that describe the file rather than generation.
_GENERATION_METADATA = ("transformers_version",)


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _content(value: Any) -> str | None:
    """A special token's text: tokenizer_config.json writes a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, special: bool) -> AddedToken | None:
    content = _content(value)
    if content is None:
        return None
    if not isinstance(value, dict):
        return AddedToken(content, special=special, normalized=not special)
    flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
    return AddedToken(content, special=bool(value.get("special", special)), **flags)


class Tokenizer:
    """The tokenizer of a model directory (tokenizer.json / tokenizer_config.json, loaded from local files only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        tokenizer_json = self.path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ValueError(f"cannot load a tokenizer from {self.path}: it has no tokenizer.json")
        try:
            self._tok = _Backend.from_file(str(tokenizer_json))
        except Exception as e:  # the Rust side raises plain Exception for unreadable or malformed files
            raise ValueError(f"cannot load a tokenizer from {self.path}: {e}") from e
        # Encoding never truncates or pads, whatever tokenizer.json says (transformers does neither by default).
        self._tok.no_truncation()
        self._tok.no_padding()
        tok_config = read_json(self.path / "tokenizer_config.json")
        config = read_json(self.path / "config.json")
        self._generation = read_json(self.path / "generation_config.json")

        # bos_token, eos_token, ... and model-specific ones (image_token): the chat template sees them all.
        self._special_tokens: dict[str, str] = {}
        for key, value in tok_config.items():
            if key.endswith("_token") and (content := _content(value)) is not None:
                self._special_tokens[key] = content
        self._add_missing_tokens(tok_config)
        self.chat_template: str | None = chat_template.load_chat_template(self.path, tok_config)

        eos = self._token_ids([self._special_tokens.get("eos_token")])
        eos += _eos_ids(config.get("eos_token_id")) + _eos_ids(self._generation.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        bos: Any = next(iter(self._token_ids([self._special_tokens.get("bos_token")])), None)
        if bos is None:
            bos = config.get("bos_token_id", self._generation.get("bos_token_id"))
        self.bos_token_id: int | None = None if bos is None else int(bos)

    def _token_ids(self, tokens: Iterable[str | None]) -> list[int]:
        ids = (self._tok.token_to_id(t) for t in tokens if t is not None)
        return [i for i in ids if i is not None]

    def _add_missing_tokens(self, tok_config: dict[str, Any]) -> None:
        # transformers adds the config's tokens that tokenizer.json lacks (usually none): added_tokens_decoder in id
        # order, then the named special tokens, then extra_special_tokens.
        known = set(self._tok.get_vocab(with_added_tokens=True))
        candidates: list[AddedToken | None] = []
        decoder = tok_config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            for _, value in sorted(decoder.items(), key=lambda kv: int(kv[0])):
                candidates.append(_added_token(value, special=False))
        for key, value in tok_config.items():
            if key.endswith("_token"):
                candidates.append(_added_token(value, special=True))
        extra = tok_config.get("extra_special_tokens", tok_config.get("additional_special_tokens"))
        if isinstance(extra, dict):
            extra = list(extra.values())
        if isinstance(extra, list):
            candidates += [_added_token(v, special=True) for v in extra]
        missing = []
        for token in candidates:
            if token is not None and token.content not in known:
                missing.append(token)
                known.add(token.content)
        if missing:
            self._tok.add_tokens(missing)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model may pad its embedding)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...) as tokenizer_config.json gives them."""
        return dict(self._special_tokens)

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's generation_config.json (temperature, top_p, top_k, repetition_penalty, max_new_tokens,
        eos_token_id, ... whatever it holds) without file metadata; {} when there is none. A fresh copy."""
        return {
            k: copy.deepcopy(v)
            for k, v in self._generation.items()
            if not k.startswith("_") and k not in _GENERATION_METADATA
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch entry releases the GIL while it works (`encode` holds it: a long text tokenized in a thread
        # froze the gateway's event loop) and skips the offsets nobody reads: the same ids, about twice as fast.
        return list(self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No tokenization-space cleanup: decoding stays a pure function of the tokens' bytes, which is what makes
        # incremental detokenization add up to the same text.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text, rendered with the model's chat template."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        return chat_template.render(self.chat_template, messages, add_generation_prompt, **self._special_tokens)

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
