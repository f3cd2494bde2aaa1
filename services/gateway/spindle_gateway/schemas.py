"""Request bodies of /v1/chat/completions and /v1/completions, and their validation.

Bodies are parsed here rather than by FastAPI so that every failure is a 400 in the OpenAI error shape (invalid
JSON included). Unknown fields are ignored. Value checks that need the model (context length, vocabulary) live
in inputs.py.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import bad_request, validation_message

M = TypeVar("M", bound=BaseModel)

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what msgpack carries
MAX_CHOICES = 128  # n: choices per request (each decodes in its own copy of the prompt's KV)


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool | None = False


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[ContentPart] | None = None


class _GenerateRequest(_Base):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Known OpenAI / vLLM fields that Spindle does not implement yet: refused with a 400 naming them when set
    # (a 200 that silently ignores them would be wrong). Fields nobody names are ignored, as OpenAI does.
    best_of: int | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: bool | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(body: bytes, model_type: type[M]) -> M:
    """JSON bytes -> a validated request model; anything wrong is a 400."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)  # lone surrogate escapes pass; checked later
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"invalid JSON in the request body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model_type.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(list(e.errors(include_url=False)))
        raise bad_request(message, param) from None


def check_text(text: str, param: str) -> str:
    """Text must be valid Unicode: JSON lets a client send a lone surrogate (e.g. "\\ud800"), UTF-8 does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param} contains a lone surrogate at position {e.start}; text must be valid Unicode", param
        ) from None
    return text


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and string content (text parts joined)."""
    if not req.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(req.messages):
        param = f"messages.{i}.content"
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"only text content parts are supported, got type {part.type!r}", param)
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": check_text(m.role, f"messages.{i}.role"), "content": check_text(content, param)})
    return out


def stop_strings(stop: str | list[str] | None, limit: int) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limit:
        raise bad_request(f"too many stop strings: {len(stops)} (at most {limit})", "stop")
    for i, s in enumerate(stops):
        if not s:
            raise bad_request("stop strings must be non-empty", "stop")
        check_text(s, f"stop.{i}" if not isinstance(stop, str) else "stop")
    return tuple(dict.fromkeys(stops))


_UNSUPPORTED = {  # field -> why, for fields refused when set to anything but their neutral value
    "best_of": "best_of > 1 is not supported",
    "guided_grammar": "guided_grammar is not supported (send guided_json, guided_regex or guided_choice)",
    "use_beam_search": "beam search is not supported",
    "suffix": "suffix is not supported (the model has no fill-in-the-middle template)",
}
_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (None, 1), "use_beam_search": (None, False)}


def refuse_unsupported(req: BaseModel) -> None:
    for name, why in _UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value not in _NEUTRAL.get(name, (None,)):
            raise bad_request(f"{why}; remove `{name}` from the request", name)


def _in_range(value: float | None, default: float, lo: float, hi: float, name: str, lo_open: bool = False) -> float:
    v = default if value is None else value
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise bad_request(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's `{"token id": bias}` -> {id: bias}, ids in the vocabulary and biases in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias names token {token}, not a token id of this model", "logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for {token}", "logit_bias")
        out[token] = float(value)
    return out


def check_common(req: _GenerateRequest, vocab_size: int, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Range checks of the sampling fields; returns them with defaults filled in: the model's generation config
    (`defaults`: temperature, top_p, top_k, min_p, repetition_penalty) where it has them, else vLLM's."""
    refuse_unsupported(req)
    d = defaults or {}
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    temperature = _in_range(req.temperature, d.get("temperature", 1.0), 0, math.inf, "temperature")
    top_p = _in_range(req.top_p, d.get("top_p", 1.0), 0, 1, "top_p", lo_open=True)
    top_k = d.get("top_k", -1) if req.top_k is None else req.top_k
    top_k = -1 if top_k == 0 else top_k
    if top_k < -1:
        raise bad_request(f"top_k must be -1 (disabled) or positive, got {top_k}", "top_k")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}", "seed")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {min_tokens}", "min_tokens")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": int(top_k),
        "min_p": _in_range(req.min_p, d.get("min_p", 0.0), 0, 1, "min_p"),
        "seed": req.seed,
        "ignore_eos": bool(req.ignore_eos),
        "min_tokens": int(min_tokens),
        "presence_penalty": _in_range(req.presence_penalty, 0.0, -2, 2, "presence_penalty"),
        "frequency_penalty": _in_range(req.frequency_penalty, 0.0, -2, 2, "frequency_penalty"),
        "repetition_penalty": _in_range(
            req.repetition_penalty, d.get("repetition_penalty", 1.0), 0, math.inf, "repetition_penalty", lo_open=True
        ),
        "logit_bias": logit_bias(req.logit_bias, vocab_size),
        "n": n,
    }


def check_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value
