"""From a validated request body to what the control plane gets: prompt token ids and sampling parameters.

Everything here is local (tokenizer and limits): an invalid request never reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from spindle_protocol.messages import Sampling
from spindle_tokenizer import Tokenizer

from . import tokenization
from .errors import bad_request
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_common,
    check_max_tokens,
    check_text,
    stop_strings,
)
from .structured import structure

Kind = Literal["chat", "completion"]
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit; the engine's too)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_stop_strings: int
    default_max_tokens: int | None = None  # a request without max_tokens gets at most this many (None: the context)
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # the model's generation_config.json


@dataclass(frozen=True)
class GenerationParams:
    kind: Kind
    prompt_ids: list[int]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: str | None = None  # completions with `echo`: the prompt's text, sent before the completion
    tool_call: bool = False  # the output is a constrained tool call (structured.py): answered as tool_calls


async def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool, limit: int, param: str) -> list[int]:
    """The prompt's token ids; a text known to reach `limit` tokens is refused without tokenizing it (so a
    multi-megabyte prompt costs no tokenizer time), long ones are tokenized off the event loop (tokenization.py)."""
    try:
        return await tokenization.encode(tokenizer, text, add_special_tokens, limit)
    except tokenization.PromptTooLong as e:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt has at least "
            f"{e.at_least} tokens ({e.chars} characters). Please reduce the length of the prompt.",
            param,
        ) from None


def _check_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(f"{param}[{i}] = {t} is not a token id of this model (0..{vocab_size - 1})", param)
    return ids


def _max_tokens(requested: int | None, prompt_len: int, limits: Limits, kind: Kind, param: str) -> int:
    """vLLM's rule: prompt + output must fit the context; the default fills it (completions: 16 at most)."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
                "messages" if kind == "chat" else "prompt",
            )
        if kind == "completion":
            default = COMPLETION_DEFAULT_MAX_TOKENS
        else:  # the server's --default-max-tokens, else the model's max_new_tokens, else all the room (vLLM's)
            default = limits.default_max_tokens or limits.generation_defaults.get("max_new_tokens")
        return min(room, default) if default else room
    if prompt_len + requested > limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion "
            f"({param})). Please reduce the length of the prompt or {param}.",
            param,
        )
    return requested


def _finish(
    kind: Kind,
    req: ChatCompletionRequest | CompletionRequest,
    ids: list[int],
    requested: int | None,
    param: str,
    limits: Limits,
    common: dict,
    stops: tuple[str, ...],
    logprobs: int | None,
    echo: str | None = None,
) -> GenerationParams:
    if not ids:
        raise bad_request("the prompt is empty", "messages" if kind == "chat" else "prompt")
    stop_ids = _check_ids(list(req.stop_token_ids or []), limits.vocab_size, "stop_token_ids")
    max_tokens = _max_tokens(requested, len(ids), limits, kind, param)
    if common["min_tokens"] > max_tokens:
        raise bad_request(f"min_tokens ({common['min_tokens']}) must not exceed {param} ({max_tokens})", "min_tokens")
    shape = structure(req)
    prompt_logprobs = _prompt_logprobs(req, common["n"])
    sampling = Sampling(
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=shape.grammar,
        **common,
    )
    include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
    return GenerationParams(kind, ids, sampling, stops, bool(req.stream), include_usage, echo, shape.tool_call)


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """OpenAI chat: `logprobs: true` for the sampled tokens' logprobs, `top_logprobs: N` for N alternatives."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _completion_logprobs(req: CompletionRequest) -> int | None:
    """OpenAI completions: `logprobs: N` for the sampled token's and the N most likely tokens' logprobs."""
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    return req.logprobs


def _prompt_logprobs(req: ChatCompletionRequest | CompletionRequest, n: int) -> int | None:
    """vLLM's `prompt_logprobs: N`; completions with `echo` and `logprobs` need them too (OpenAI's echo returns the
    prompt's logprobs). Computed by the prefill instance, one choice only."""
    value = req.prompt_logprobs
    if value is None and isinstance(req, CompletionRequest) and req.echo:
        value = req.logprobs
    if value is None:
        return None
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {value}", "prompt_logprobs")
    if n > 1:
        raise bad_request("prompt logprobs (prompt_logprobs, or echo with logprobs) need n = 1", "n")
    return value


async def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits) -> GenerationParams:
    common = check_common(req, limits.vocab_size, limits.generation_defaults)
    logprobs = _chat_logprobs(req)
    stops = stop_strings(req.stop, limits.max_stop_strings)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = check_max_tokens(
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, param
    )
    messages = chat_messages(req)
    try:
        text = tokenizer.render_chat(messages)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    ids = await _encode(tokenizer, text, False, limits.max_model_len, "messages")  # the template adds BOS
    return _finish("chat", req, ids, requested, param, limits, common, stops, logprobs)


async def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> GenerationParams:
    common = check_common(req, limits.vocab_size, limits.generation_defaults)
    logprobs = _completion_logprobs(req)
    stops = stop_strings(req.stop, limits.max_stop_strings)
    requested = check_max_tokens(req.max_tokens, "max_tokens")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _encode(tokenizer, check_text(prompt, "prompt"), True, limits.max_model_len, "prompt")
        echo = prompt if req.echo else None
    else:
        ids = _check_ids(list(prompt), limits.vocab_size, "prompt")
        echo = tokenizer.decode(ids) if req.echo else None
    return _finish("completion", req, ids, requested, "max_tokens", limits, common, stops, logprobs, echo)
