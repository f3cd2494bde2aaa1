"""Tokenizing request text without letting one request hold the gateway: a prompt that certainly exceeds the
context is refused before it is tokenized, and long texts are tokenized in a thread, a bounded number at a time.

"Certainly exceeds" comes from the tokenizer's own files. When nothing in its pipeline can drop or merge input
characters (a BPE over bytes or with byte fallback; no normalizer or pre-tokenizer that removes characters; no
added token that swallows neighbouring whitespace), every token stands for at most `chars_per_token` characters
of the text: its longest vocabulary string, scaled by how far the normalizer can shrink text (Unicode composition
folds up to 4 code points into one). A text of n characters then has at least ceil(n / chars_per_token) tokens.
A prompt that fits always passes this check and is tokenized exactly as before; for a tokenizer where no such
bound holds, every text is tokenized (in a thread, bounded).
"""

from __future__ import annotations

import asyncio
import json
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

THREAD_CHARS = 8192  # longer texts are tokenized off the event loop
THREAD_TOKENS = 8192  # longer id lists are detokenized off the event loop
THREAD_SLOTS = 2  # tokenizations running in threads at once; more wait their turn
MAX_COMPOSITION = 4  # NFC/NFKC fold at most this many code points into one (U+1F82 is 4 when decomposed)

# Pre-tokenizers that keep every character (Split and Punctuation unless their behaviour is "removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


class TextTokenizer(Protocol):
    path: Path

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class PromptTooLong(ValueError):
    """The text has at least `at_least` tokens, which is known to exceed the limit without tokenizing it."""

    def __init__(self, at_least: int, chars: int) -> None:
        super().__init__(f"at least {at_least} tokens ({chars} characters)")
        self.at_least = at_least
        self.chars = chars


# ---- what the tokenizer's files guarantee ----


def _normalizer_shrink(spec: dict[str, Any] | None) -> float | None:
    """How many input characters at most become one normalized character (None: unbounded, e.g. removals)."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1.0
    if kind in ("NFC", "NFKC"):
        return float(MAX_COMPOSITION)
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if not isinstance(literal, str) or not literal or not isinstance(content, str) or not content:
            return None  # a regex, or a deletion
        return max(1.0, len(literal) / len(content))
    return None  # Strip, StripAccents, BertNormalizer (drops control characters), Precompiled, unknown


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    if kind not in _KEEPING_PRE_TOKENIZERS:
        return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop characters
    return str(spec.get("behavior", "")).lower() != "removed"


def _is_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _config_added_tokens(config: dict[str, Any]) -> list[Any]:
    """Tokens tokenizer_config.json may add on top of tokenizer.json (what loading tokenizers add when missing)."""
    tokens: list[Any] = []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        tokens += list(decoder.values())
    tokens += [v for k, v in config.items() if k.endswith("_token")]
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    if isinstance(extra, dict):
        extra = list(extra.values())
    if isinstance(extra, list):
        tokens += extra
    return tokens


def chars_per_token(spec: dict[str, Any], config: dict[str, Any] | None = None) -> float | None:
    """The most characters of input text one token can stand for, from tokenizer.json (and tokenizer_config.json's
    extra tokens); None when the pipeline may drop or merge characters, so that no such bound holds."""
    if spec.get("truncation"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model") or {}
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")) or model.get("type") != "BPE":
        return None
    covers_all = _is_byte_level(spec.get("pre_tokenizer")) or bool(model.get("byte_fallback"))
    if not covers_all and (model.get("unk_token") is None or model.get("fuse_unk")):
        return None  # characters outside the vocabulary vanish, or runs of them fuse into one token
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        return None
    longest = max(len(token) for token in vocab)
    for added in [*spec.get("added_tokens", []), *_config_added_tokens(config or {})]:
        if isinstance(added, dict):
            if added.get("lstrip") or added.get("rstrip"):
                return None  # swallows any amount of whitespace beside it
            added = added.get("content")
        if isinstance(added, str):
            longest = max(longest, len(added))
    return longest * shrink


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class TokenizerFacts:
    chars_per_token: float | None  # see chars_per_token(); None: every text is tokenized
    token_strings: dict[int, str] = field(default_factory=dict)  # id -> vocabulary string ("Ġthe"), added tokens too


@lru_cache(maxsize=4)
def tokenizer_facts(directory: Path | None) -> TokenizerFacts:
    """What the gateway needs from a tokenizer directory's tokenizer.json, read once."""
    spec = _read_json(directory / "tokenizer.json") if directory is not None else {}
    if not spec:
        return TokenizerFacts(None)
    bound = chars_per_token(spec, _read_json(directory / "tokenizer_config.json"))
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    strings: dict[int, str] = {}
    if isinstance(vocab, dict):
        strings = {i: s for s, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        strings = {i: entry[0] for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    for added in spec.get("added_tokens", []):
        if isinstance(added, dict) and isinstance(added.get("id"), int) and isinstance(added.get("content"), str):
            strings[added["id"]] = added["content"]
    return TokenizerFacts(bound, strings)


def facts(tokenizer: TextTokenizer) -> TokenizerFacts:
    path = getattr(tokenizer, "path", None)
    return tokenizer_facts(Path(path) if path is not None else None)


def token_strings(tokenizer: TextTokenizer, ids: list[int]) -> list[str]:
    """Each id's vocabulary string (vLLM's `token_strs`); an id tokenizer.json does not name decodes alone."""
    table = facts(tokenizer).token_strings
    return [s if (s := table.get(i)) is not None else tokenizer.decode([i], skip_special_tokens=False) for i in ids]


# ---- bounded work off the event loop ----

_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _loop_slots() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(THREAD_SLOTS)
    return slots


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread, at most THREAD_SLOTS at once (per event loop)."""
    async with _loop_slots():
        return await asyncio.to_thread(fn, *args)


async def encode(tokenizer: TextTokenizer, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int]:
    """The text's token ids; raises PromptTooLong, without tokenizing, when it certainly has `limit` tokens or more."""
    if limit is not None:
        bound = facts(tokenizer).chars_per_token
        if bound is not None:
            at_least = math.ceil(len(text) / bound)
            if at_least >= limit:
                raise PromptTooLong(at_least, len(text))
    if len(text) > THREAD_CHARS:
        return await in_thread(tokenizer.encode, text, add_special_tokens)
    return tokenizer.encode(text, add_special_tokens)


async def decode(tokenizer: TextTokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    if len(ids) > THREAD_TOKENS:
        return await in_thread(tokenizer.decode, ids, skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens)
