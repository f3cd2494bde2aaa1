"""Response objects and SSE chunks, in the shapes vLLM and OpenAI serve.

Chat stream: a role chunk (`{"role": "assistant", "content": ""}`) once the first token exists, content deltas,
`finish_reason` on the last choice chunk, a separate `choices: []` usage chunk when `include_usage`, then
`data: [DONE]`. Completions stream the same way with `text` instead of `delta`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from spindle_protocol.messages import TokenLogprob

from .inputs import Kind
from .structured import tool_calls

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a banned token's logprob is reported as this (vLLM does the same)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


# `usage.spindle`: these keys on every response, whatever the workers reported (the keys they write in their jobs'
# `stats`; a key they add must be added here). Times and kv_bytes are null when the instance that sent the last
# event did not measure them (transfer_ms of a request that ended on its prefill instance); the counts are 0 when
# the stats do not mention them. All are null when no stats came (a stop string ended the request first).
# csa_dropped_tokens: prompt tokens CSA dropped at level 2 (in each dropping layer, for each head; 0 without CSA).
SPINDLE_USAGE_KEYS = (
    "prefill_ms", "transfer_ms", "resume_ms", "decode_ms", "kv_bytes", "parked", "preemptions", "csa_dropped_tokens",
)  # fmt: skip
_SPINDLE_COUNTS = frozenset({"parked", "preemptions", "csa_dropped_tokens"})
_SPINDLE_INTEGERS = frozenset({"kv_bytes", "parked", "preemptions", "csa_dropped_tokens"})


def spindle_usage(stats: dict[str, float] | None) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {}
    for key in SPINDLE_USAGE_KEYS:
        value = None if stats is None else stats.get(key, 0 if key in _SPINDLE_COUNTS else None)
        out[key] = int(value) if value is not None and key in _SPINDLE_INTEGERS else value
    return out


def usage(prompt_tokens: int, completion_tokens: int, stats: dict[str, float] | None = None) -> dict[str, Any]:
    """OpenAI usage; Spindle's per-request measurements (from the last StreamEvent) ride along under `spindle`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "spindle": spindle_usage(stats),
    }


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


@dataclass
class ChoiceOutput:
    """One choice of a non-streaming response, as it accumulates."""

    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob | None] | None = None


class ResponseBuilder:
    """Builds one request's response objects (non-stream) or chunks (stream).

    `token_text(id)` is one token's text, for logprobs: OpenAI's `token` (and `bytes`, its UTF-8) per position.
    A token that is part of a multi-byte character shows the replacement character there, as in vLLM."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        include_usage: bool = False,
        token_text: Callable[[int], str] | None = None,
        echo: str | None = None,
        tool_call: bool = False,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.token_text = token_text or str
        self.echo = echo
        self.tool_call = tool_call  # chat: a finished choice's text is a constrained call, sent as tool_calls
        self.prompt: tuple[list[int], list[TokenLogprob]] | None = None  # prompt ids and logprobs (set_prompt)
        self._offsets: dict[int, int] = {}  # completions' text_offset of each choice's next token
        self._chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def set_prompt(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob] | None) -> None:
        """The prompt's logprobs, once they arrived (with the first output): for `prompt_logprobs` (vLLM's field on
        each choice) and for completions with `echo` and `logprobs` (OpenAI's: the prompt's tokens come first)."""
        if prompt_logprobs is not None and self.prompt is None:
            self.prompt = (prompt_ids, prompt_logprobs)

    def prompt_logprobs(self) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then `{token id: {logprob, decoded_token}}` for
        the token and its alternatives."""
        if self.prompt is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for e in self.prompt[1]:
            entry = {str(e.token_id): {"logprob": _lp(e.logprob), "decoded_token": self.token_text(e.token_id)}}
            for t, v in zip(e.top_ids, e.top_logprobs, strict=True):
                entry.setdefault(str(t), {"logprob": _lp(v), "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def logprobs(self, entries: Sequence[TokenLogprob | None] | None, index: int = 0) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object of choice `index` for these positions (None when the request asked for
        none). Completions with `echo`: the first call puts the prompt's tokens first (the first with no logprob)."""
        if entries is None:
            return None
        known = [e for e in entries if e is not None]
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in known]}
        prefix: list[TokenLogprob | None] = []
        if self.echo is not None and self.prompt is not None and index not in self._offsets:
            self._offsets[index] = 0
            prefix = [None, *self.prompt[1]]
        texts = [self.token_text(self.prompt[0][0])] if prefix and self.prompt else []
        texts += [self.token_text(e.token_id) for e in [*prefix[1:], *known]]
        offsets, offset = [], self._offsets.get(index, len(self.echo or ""))
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        self._offsets[index] = offset
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else _lp(e.logprob) for e in [*prefix, *known]],
            "top_logprobs": [None if e is None else self._top(e) for e in [*prefix, *known]],
            "text_offset": offsets,
        }

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(e.token_id): _lp(e.logprob)}
        return top | {self.token_text(t): _lp(v) for t, v in zip(e.top_ids, e.top_logprobs, strict=True)}

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        text = self.token_text(e.token_id)
        return {
            "token": text,
            "logprob": _lp(e.logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (alt := self.token_text(t)), "logprob": _lp(v), "bytes": list(alt.encode())}
                for t, v in zip(e.top_ids, e.top_logprobs, strict=True)
            ],
        }

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

    def role_chunk(self, index: int = 0) -> bytes:
        assert self.kind == "chat"
        return sse(
            self._chunk(
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
        )

    def delta_chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        logprobs: Sequence[TokenLogprob | None] | None = None,
        index: int = 0,
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
    ) -> bytes:
        choice: dict[str, Any] = {"index": index}
        if prompt_logprobs is not None:  # vLLM's: once, on the first chunk after they arrived
            choice["prompt_logprobs"] = prompt_logprobs
        if self.kind == "chat":
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(logprobs, index)
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return sse(self._chunk(choice))

    def tool_call_chunk(self, text: str, finish_reason: str, index: int = 0) -> bytes:
        """Streamed tool call: the whole call in one delta when its choice finishes (the text itself is not
        streamed), with finish_reason "tool_calls"; a call cut short (max_tokens) comes as content instead."""
        calls = tool_calls(text)
        if calls is None:
            return self.delta_chunk(text, finish_reason, index=index)
        delta = {"tool_calls": [{"index": 0, **calls[0]}]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}
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

    def echo_chunk(self, index: int = 0) -> bytes:
        """Completions with `echo`, streamed: the prompt's text comes first, in a chunk of its own."""
        assert self.kind == "completion" and self.echo is not None
        return sse(self._chunk({"index": index, "text": self.echo, "logprobs": None, "finish_reason": None}))

    def response(self, choices: Sequence[ChoiceOutput], usage_: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming response object."""
        out = []
        for index, c in enumerate(choices):
            choice: dict[str, Any] = {"index": index}
            calls = tool_calls(c.text) if self.tool_call else None
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = (self.echo or "") + c.text
            choice["logprobs"] = self.logprobs(c.logprobs, index)
            choice["finish_reason"] = "tool_calls" if calls is not None else c.finish_reason
            choice["stop_reason"] = c.stop_reason
            if self.prompt is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs()
            out.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": usage_,
        }


def error_event(body: dict[str, Any]) -> bytes:
    """An error after streaming started: the `{"error": ...}` event (then the caller sends DONE)."""
    return sse(body)
