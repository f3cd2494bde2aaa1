"""Response objects and SSE chunks, in the shapes vLLM and OpenAI serve.

Chat stream: a role chunk (`{"role": "assistant", "content": ""}`) once the first token exists, content deltas,
`finish_reason` on the last choice chunk, a separate `choices: []` usage chunk when `include_usage`, then
`data: [DONE]`. Completions stream the same way with `text` instead of `delta`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .inputs import Kind

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, stats: dict[str, float] | None = None) -> dict[str, Any]:
    """OpenAI usage; Spindle's per-request measurements (from the last StreamEvent) ride along under `spindle`."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if stats:
        out["spindle"] = dict(stats)
    return out


class ResponseBuilder:
    """Builds one request's response objects (non-stream) or chunks (stream)."""

    def __init__(self, kind: Kind, request_id: str, model: str, created: int, include_usage: bool = False) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every choice chunk when usage comes in a chunk of its own
        return out

    def role_chunk(self) -> bytes:
        assert self.kind == "chat"
        return sse(
            self._chunk(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
        )

    def delta_chunk(self, text: str, finish_reason: str | None = None, stop_reason: str | int | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return sse(self._chunk(choice))

    def usage_chunk(self, usage_: dict[str, Any]) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": self._chunk_object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_,
            }
        )

    def response(
        self, text: str, finish_reason: str, usage_: dict[str, Any], stop_reason: str | int | None = None
    ) -> dict[str, Any]:
        """The whole non-streaming response object."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_,
        }


def error_event(body: dict[str, Any]) -> bytes:
    """An error after streaming started: the `{"error": ...}` event (then the caller sends DONE)."""
    return sse(body)
