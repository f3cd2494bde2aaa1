"""Pure unit tests: validation, stop strings, incremental text, reordering, SSE chunk shapes, error JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from spindle_gateway.errors import GatewayError
from spindle_gateway.inputs import Limits, prepare_chat, prepare_completion
from spindle_gateway.reorder import TokenReorderer
from spindle_gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from spindle_gateway.sse import DONE, SPINDLE_USAGE_KEYS, ChoiceOutput, ResponseBuilder, error_event, usage
from spindle_gateway.stops import StopStringMatcher, TextAssembler
from spindle_model import Tokenizer
from spindle_protocol.messages import StreamEvent

LIMITS = Limits(max_model_len=64, vocab_size=49152, max_stop_strings=4)
UNICODE = "café 🙂 naïve 日本語"


def chat(body: dict, tokenizer: Tokenizer, limits: Limits = LIMITS):
    return asyncio.run(prepare_chat(parse_body(json.dumps(body).encode(), ChatCompletionRequest), tokenizer, limits))


def completion(body: dict, tokenizer: Tokenizer, limits: Limits = LIMITS):
    return asyncio.run(prepare_completion(parse_body(json.dumps(body).encode(), CompletionRequest), tokenizer, limits))


def rejects(fn, *args, status: int = 400, match: str = "") -> GatewayError:
    with pytest.raises(GatewayError) as info:
        fn(*args)
    assert info.value.status == status
    assert match in info.value.message, info.value.message
    return info.value


# ---- validation ----


def test_parse_body_errors_are_400() -> None:
    for body in (b"", b"{", b"[]", b'"x"', b"\xff\xfe", b'{"prompt": "x", "top_p": Infinity}'):
        rejects(parse_body, body, CompletionRequest)
    err = rejects(parse_body, b'{"prompt": "x", "max_tokens": "many"}', CompletionRequest)
    assert err.param == "max_tokens"
    assert parse_body(b'{"prompt": "x", "frequency_penalty": 0.3, "user": "u"}', CompletionRequest).prompt == "x"


def test_chat_defaults_and_sampling(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = chat({"messages": messages}, tokenizer)
    assert p.prompt_ids == tokenizer.apply_chat_template(messages)
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (1.0, 1.0, -1, None, False)
    assert s.max_tokens == LIMITS.max_model_len - len(p.prompt_ids)
    assert p.stop == () and not p.stream and not p.include_usage
    p = chat(
        {
            "messages": messages,
            "max_tokens": 5,
            "max_completion_tokens": 3,
            "top_k": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["a", "a", "b"],
        },
        tokenizer,
    )
    assert p.sampling.max_tokens == 3 and p.sampling.top_k == -1 and p.stream and p.include_usage
    assert p.stop == ("a", "b")


def test_chat_content_parts_are_joined(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert chat({"messages": [{"role": "user", "content": parts}]}, tokenizer).prompt_ids == (
        chat({"messages": [{"role": "user", "content": "Hello there"}]}, tokenizer).prompt_ids
    )


def test_completion_prompt_forms(tokenizer: Tokenizer) -> None:
    text = completion({"prompt": "Hello"}, tokenizer)
    assert text.prompt_ids == tokenizer.encode("Hello") and text.sampling.max_tokens == 16
    assert completion({"prompt": ["Hello"]}, tokenizer).prompt_ids == text.prompt_ids
    assert completion({"prompt": [[5, 6]]}, tokenizer).prompt_ids == [5, 6]
    assert completion({"prompt": [1] * 60}, tokenizer).sampling.max_tokens == 4  # what is left of the context


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "n must be in"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.01}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "too many stop"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 60}, "maximum context length is 64"),
    ],
)
def test_chat_rejections(tokenizer: Tokenizer, body: dict, match: str) -> None:
    rejects(chat, body, tokenizer, match=match)


def test_surrogates_are_rejected(tokenizer: Tokenizer) -> None:
    body = b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'
    req = parse_body(body, ChatCompletionRequest)
    rejects(lambda: asyncio.run(prepare_chat(req, tokenizer, LIMITS)), match="lone surrogate")
    req = parse_body(b'{"prompt": "ok", "stop": "\\ud800"}', CompletionRequest)
    rejects(lambda: asyncio.run(prepare_completion(req, tokenizer, LIMITS)), match="lone surrogate")


def test_context_overflow_names_both_numbers(tokenizer: Tokenizer) -> None:
    err = rejects(completion, {"prompt": [1] * 50, "max_tokens": 20}, tokenizer)
    assert "64" in err.message and "50" in err.message and "20" in err.message
    rejects(completion, {"prompt": [1] * 64}, tokenizer, match="no room")


# ---- stop strings and incremental text ----


def test_stop_string_across_pieces() -> None:
    m = StopStringMatcher(["lo w"])
    assert m.feed("Hel") == ""  # up to len(stop) - 1 characters are held back
    assert m.feed("lo wo") == "Hel" and m.matched == "lo w"


def test_stop_string_hold_back_and_flush() -> None:
    m = StopStringMatcher(["xyz"])
    assert m.feed("abcx") == "ab"  # the last len("xyz") - 1 characters wait: they may start a stop string
    assert m.feed("y") == "c"
    assert m.feed("q") == "x"
    assert m.flush() == "yq" and m.matched is None
    assert StopStringMatcher([]).feed("anything") == "anything"


def test_first_completed_stop_string_wins() -> None:
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xabc") == "xa" and m.matched == "bc"
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == "xa" and m.matched == "bc"  # "bc" completes first even when both arrive together


def test_text_assembler_is_utf8_safe_and_counts_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    asm = TextAssembler(tokenizer, [])
    pieces = [asm.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + asm.finish() == UNICODE and asm.completion_tokens == len(ids)


def test_text_assembler_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    text = "The capital of France is Paris. It is big."
    ids = tokenizer.encode(text, add_special_tokens=False)
    asm = TextAssembler(tokenizer, ["is Par"])
    out = "".join(asm.add([t]) for t in ids)
    assert out == "The capital of France " and asm.stopped == "is Par" and asm.finish() == ""
    prefix_tokens = next(k for k in range(len(ids) + 1) if "is Par" in tokenizer.decode(ids[:k]))
    assert asm.completion_tokens == prefix_tokens  # tokens after the match are not consumed


def test_text_assembler_matches_stop_in_flushed_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab 🙂", add_special_tokens=False)
    asm = TextAssembler(tokenizer, ["🙂"])
    out = asm.add(ids) + asm.finish()
    assert out == "ab " and asm.stopped == "🙂"


# ---- reordering ----


def ev(seq: int, tokens: list[int], finished: bool = False, **kw) -> StreamEvent:
    return StreamEvent(request_id="r", seq=seq, token_ids=tokens, finished=finished, **kw)


def test_reorder_out_of_order_and_duplicates() -> None:
    r = TokenReorderer()
    assert r.push(ev(1, [11, 12])) == [] and r.missing == 2
    assert r.push(ev(3, [13], finished=True, finish_reason="length", stats={"x": 1.0})) == []
    assert not r.complete
    assert r.push(ev(0, [10])) == [10, 11, 12, 13]
    assert r.complete and r.finish_reason == "length" and r.stats == {"x": 1.0}
    assert r.push(ev(1, [11])) == []  # a repeat changes nothing


def test_reorder_finished_event_without_tokens_and_late_tokens() -> None:
    r = TokenReorderer()
    assert r.push(ev(0, [1, 2, 3, 4])) == [1, 2, 3, 4]
    assert r.push(ev(2, [], finished=True)) == [] and r.complete and r.finish_reason == "stop"
    r = TokenReorderer()
    r.push(ev(5, [9]))  # beyond the end: dropped when the end becomes known
    r.push(ev(1, [], finished=True))
    assert r.push(ev(0, [7])) == [7] and r.complete and r.missing == 0
    assert TokenReorderer().push(ev(-1, [1])) == []


# ---- SSE shapes and errors ----


def decode_sse(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2
    return json.loads(chunk[6:])


def test_chat_chunks() -> None:
    b = ResponseBuilder("chat", "chatcmpl-1", "m", 123, include_usage=True)
    role = decode_sse(b.role_chunk())
    assert role == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    }
    assert decode_sse(b.delta_chunk("Hi"))["choices"][0]["delta"] == {"content": "Hi"}
    last = decode_sse(b.delta_chunk("", "stop", "\n"))["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop" and last["stop_reason"] == "\n"
    u = usage(3, 2, {"decode_ms": 1.0, "kv_bytes": 64.0, "unknown_ms": 5.0})
    spindle = dict.fromkeys(SPINDLE_USAGE_KEYS) | {
        "decode_ms": 1.0,
        "kv_bytes": 64,
        "parked": 0,
        "preemptions": 0,
        "csa_dropped_tokens": 0,
    }
    assert u == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "spindle": spindle}
    assert usage(1, 1)["spindle"] == dict.fromkeys(SPINDLE_USAGE_KEYS)
    assert decode_sse(b.usage_chunk(u)) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "m",
        "choices": [],
        "usage": u,
    }
    assert DONE == b"data: [DONE]\n\n"


def test_completion_chunks_and_response() -> None:
    b = ResponseBuilder("completion", "cmpl-1", "m", 5)
    c = decode_sse(b.delta_chunk("x", "length"))
    assert c["object"] == "text_completion" and "usage" not in c
    assert c["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    r = b.response([ChoiceOutput("hello", "stop")], usage(1, 1))
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "hello"
    r = ResponseBuilder("chat", "c", "m", 5).response([ChoiceOutput("hi", "stop")], usage(1, 1))
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_error_json() -> None:
    err = GatewayError(429, "slow down", retry_after=2.1)
    resp = err.response()
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
    assert json.loads(resp.body) == {
        "error": {"message": "slow down", "type": "RateLimitError", "param": None, "code": 429}
    }
    assert GatewayError(400, "bad \ud800", param="stop").body()["error"]["message"] == "bad \\ud800"
    assert GatewayError(504, "late").type == "timeout" and GatewayError(418, "x").type == "BadRequestError"
    assert decode_sse(error_event(GatewayError(503, "gone").body()))["error"]["code"] == 503


def test_the_models_generation_config_gives_the_defaults(tokenizer: Tokenizer, tmp_path) -> None:
    """vLLM's `--generation-config auto`: a request that omits a sampling field gets the model's; the server's
    --default-max-tokens wins over the model's max_new_tokens; what the request sends wins over both."""
    import shutil

    from spindle_gateway.state import generation_defaults

    for f in tokenizer.path.iterdir():  # the model directory without its weights
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": 2, "do_sample": True}))
    model_tok = Tokenizer(tmp_path)
    defaults = generation_defaults(model_tok)
    assert defaults == config
    limits = Limits(max_model_len=64, vocab_size=49152, max_stop_strings=4, generation_defaults=defaults)
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    s = chat(body, model_tok, limits).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (0.6, 0.9, 50, 1.1, 7)
    s = chat({**body, "temperature": 0, "max_tokens": 9}, model_tok, limits).sampling
    assert (s.temperature, s.max_tokens) == (0.0, 9)
    server = Limits(64, 49152, 4, default_max_tokens=12, generation_defaults=defaults)
    assert chat(body, model_tok, server).sampling.max_tokens == 12
    assert completion({"prompt": "x"}, model_tok, limits).sampling.max_tokens == 16  # OpenAI's completions default
