"""`/tokenize` and `/detokenize` (also under `/v1/`), in vLLM's request and response shapes.

tokenize: `{"model"?, "prompt": str, "add_special_tokens"? (default true)}` or `{"model"?, "messages": [...],
"add_generation_prompt"? (default true), "add_special_tokens"? (default false: the chat template writes them)}`,
either with `"return_token_strs"?` -> `{"count", "max_model_len", "tokens", "token_strs"}`. As in vLLM, a text
longer than the context is still counted. detokenize: `{"model"?, "tokens": [...]}` -> `{"prompt"}` (special
tokens included, as vLLM decodes them).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from . import tokenization
from .errors import bad_request
from .inputs import _check_ids
from .schemas import ChatCompletionRequest, ChatMessage, chat_messages, check_text, parse_body


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's default for the form (prompt: true, messages: false)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


def parse_tokenize(body: bytes) -> TokenizeRequest:
    req = parse_body(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send either `prompt` (a string) or `messages` (a chat), not both or neither", "prompt")
    return req


async def tokenize(req: TokenizeRequest, tokenizer: tokenization.TextTokenizer, max_model_len: int) -> dict[str, Any]:
    if req.prompt is not None:
        text = check_text(req.prompt, "prompt")
        add_special_tokens = req.add_special_tokens is None or req.add_special_tokens
    else:
        if req.continue_final_message:
            raise bad_request("continue_final_message is not supported", "continue_final_message")
        messages = chat_messages(ChatCompletionRequest.model_construct(messages=req.messages))
        try:
            text = tokenizer.render_chat(messages, req.add_generation_prompt)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        add_special_tokens = bool(req.add_special_tokens)
    ids = await tokenization.encode(tokenizer, text, add_special_tokens)
    token_strs = tokenization.token_strings(tokenizer, ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


async def detokenize(req: DetokenizeRequest, tokenizer: tokenization.TextTokenizer, vocab_size: int) -> dict[str, Any]:
    ids = _check_ids(req.tokens, vocab_size, "tokens")
    return {"prompt": await tokenization.decode(tokenizer, ids, skip_special_tokens=False)}
