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
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


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


def check_common(req: _GenerateRequest) -> dict[str, Any]:
    """Range checks of the sampling fields; returns them with vLLM's defaults filled in."""
    if req.n is not None and req.n != 1:
        raise bad_request(f"n must be 1 (only one choice per request is supported), got {req.n}", "n")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = -1 if req.top_k in (None, 0) else req.top_k
    if top_k < -1:
        raise bad_request(f"top_k must be -1 (disabled) or positive, got {top_k}", "top_k")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}", "seed")
    return {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "seed": req.seed,
        "ignore_eos": bool(req.ignore_eos),
    }


def check_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value
