"""Request hygiene and the endpoints clients rely on besides completions: the body-size limit, over-long prompts,
/tokenize and /detokenize, /v1/models/{id}, HEAD and 405, and the fixed `usage.spindle` keys. The real gateway
over a real nats-server, with the SCRIPTED NATS PEER as scheduler and workers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from spindle_gateway.sse import SPINDLE_USAGE_KEYS
from spindle_protocol.messages import RequestSpec, StreamEvent

from .scripted_peer import MODEL, ScriptedPeer, token_events
from .test_gateway import CHAT, COMPLETION, assert_error, get, parse_sse, post

SMALL_LIMIT = 64 << 10
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chunked(data: bytes, size: int = 16 << 10) -> Iterator[bytes]:
    """A body httpx sends with Transfer-Encoding: chunked (no Content-Length)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def send(url: str, path: str, content: bytes | Iterator[bytes]) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def completion_body(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (a short prompt, then JSON whitespace)."""
    body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


@pytest.fixture
def small_gateway(harness: Any, peer: ScriptedPeer) -> str:
    if not hasattr(harness, "small_gateway"):
        harness.small_gateway = harness.start_gateway(max_body_bytes=SMALL_LIMIT)
    return harness.small_gateway.url


# ---- the body-size limit ----


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/detokenize"])
def test_body_over_the_limit_is_413_declared_or_chunked(small_gateway: str, peer: ScriptedPeer, path: str) -> None:
    body = completion_body(SMALL_LIMIT + 1000)
    for content in (body, chunked(body)):
        err = assert_error(send(small_gateway, path, content), 413)
        assert str(SMALL_LIMIT) in err["message"] and err["type"] == "PayloadTooLargeError"
    assert peer.admits == []


def test_body_at_the_limit_is_read(small_gateway: str, peer: ScriptedPeer) -> None:
    body = completion_body(SMALL_LIMIT)
    assert len(body) == SMALL_LIMIT
    for content in (body, chunked(body)):
        assert send(small_gateway, "/v1/completions", content).status_code == 200
    assert len(peer.admits) == 2


def test_ten_megabytes_are_refused_at_once_and_counted(gateway_url: str, peer: ScriptedPeer) -> None:
    body = completion_body(10 << 20)
    for content in (body, chunked(body, 64 << 10)):
        t0 = time.monotonic()
        err = assert_error(send(gateway_url, "/v1/chat/completions", content), 413)
        assert time.monotonic() - t0 < 2.0
        assert str(4 << 20) in err["message"]  # the default for an 8192-token context: the 4 MiB floor
    assert peer.admits == []
    assert (
        f'spindle:request_errors_total{{model_name="{MODEL}",status="413"}} 2.0' in get(gateway_url + "/metrics").text
    )


# ---- prompts longer than the context ----


def test_megabytes_of_prompt_are_refused_without_tokenizing(gateway_url: str, peer: ScriptedPeer) -> None:
    text = "All work and no play makes Jack a dull boy. " * 80_000  # 3.5 MB: ~1.5 s to tokenize here
    cases = [("/v1/completions", {"model": MODEL, "prompt": text}, "prompt")]
    cases.append(
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}, "messages")
    )
    for path, body, param in cases:
        t0 = time.monotonic()
        err = assert_error(post(gateway_url, path, body), 400)
        assert time.monotonic() - t0 < 0.5, time.monotonic() - t0
        assert "maximum context length is 8192" in err["message"] and "at least" in err["message"]
        assert err["param"] == param
    assert peer.admits == []


def test_a_prompt_over_the_context_but_under_the_bound_names_its_length(gateway_url: str, peer: ScriptedPeer) -> None:
    text = " Paris" * 20_000  # 120k characters: under 8192 x 81, so tokenized (20k tokens)
    err = assert_error(post(gateway_url, "/v1/completions", {"model": MODEL, "prompt": text}), 400)
    assert "your prompt has 20000 tokens" in err["message"], err["message"]


# ---- /tokenize and /detokenize ----


def tokenize(url: str, body: dict[str, Any], path: str = "/tokenize") -> dict[str, Any]:
    resp = post(url, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_tokenize_prompt_in_vllms_shape(gateway_url: str, tokenizer: Any) -> None:
    text = "The capital of France is"
    out = tokenize(gateway_url, {"model": MODEL, "prompt": text})
    ids = tokenizer.encode(text)
    assert out == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
    assert tokenize(gateway_url, {"prompt": text}, "/v1/tokenize") == out
    strs = tokenize(gateway_url, {"prompt": text, "return_token_strs": True})["token_strs"]
    assert strs == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    special = tokenize(gateway_url, {"prompt": "<|im_start|>hi", "return_token_strs": True})
    assert special["token_strs"][0] == "<|im_start|>" and special["count"] == 2


def test_tokenize_messages_matches_the_chat_prompt(gateway_url: str, tokenizer: Any, peer: ScriptedPeer) -> None:
    out = tokenize(gateway_url, {"model": MODEL, "messages": QUESTION})
    assert out["tokens"] == tokenizer.apply_chat_template(QUESTION)
    assert post(gateway_url, "/v1/chat/completions", {**CHAT, "max_tokens": 5}).status_code == 200
    assert peer.admits[0].prompt.num_tokens == out["count"]  # what generation would send
    bare = tokenize(gateway_url, {"messages": QUESTION, "add_generation_prompt": False}, "/v1/tokenize")
    assert bare["tokens"] == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=False)
    assert bare["count"] < out["count"]


def test_tokenize_counts_text_longer_than_the_context(gateway_url: str, tokenizer: Any) -> None:
    text = " Paris" * 10_000
    assert tokenize(gateway_url, {"prompt": text})["count"] == len(tokenizer.encode(text)) == 10_000


def test_detokenize_round_trip(gateway_url: str, tokenizer: Any) -> None:
    ids = tokenizer.apply_chat_template(QUESTION)
    out = post(gateway_url, "/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert out == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert out["prompt"].startswith("<|im_start|>")  # special tokens are kept, as in vLLM
    assert post(gateway_url, "/v1/detokenize", {"tokens": []}).json() == {"prompt": ""}


TOKENIZE_ERRORS: list[tuple[str, Any, int, str | None]] = [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/tokenize", b'{"prompt": "x\\ud800"}', 400, "prompt"),
    ("/v1/tokenize", b"{", 400, None),
    ("/tokenize", {"model": "gpt-5", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hello"}, 400, "tokens"),
    ("/v1/detokenize", {}, 400, "tokens"),
    ("/v1/detokenize", {"model": "gpt-5", "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), TOKENIZE_ERRORS)
def test_tokenize_errors(gateway_url: str, path: str, body: Any, status: int, param: str | None) -> None:
    assert assert_error(post(gateway_url, path, body), status)["param"] == param


# ---- models, HEAD, 405 ----


def test_model_retrieve(gateway_url: str) -> None:
    card = get(gateway_url + "/v1/models/" + MODEL).json()
    assert card == get(gateway_url + "/v1/models").json()["data"][0]
    err = assert_error(get(gateway_url + "/v1/models/gpt-5"), 404)
    assert "gpt-5" in err["message"] and err["param"] == "model"


def test_model_ids_with_slashes(harness: Any, peer: ScriptedPeer) -> None:
    gw = harness.start_gateway(served_model_name="org/some-model")
    assert get(gw.url + "/v1/models/org/some-model").json()["id"] == "org/some-model"
    assert_error(get(gw.url + "/v1/models/org/other"), 404)


def test_openai_client_retrieves_models(gateway_url: str) -> None:
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=10) as client:
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("nope")


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/" + MODEL, "/metrics", "/v1/spindle/instances"])
def test_head_on_every_get(gateway_url: str, path: str) -> None:
    resp = httpx.head(gateway_url + path, timeout=5)
    assert resp.status_code == 200 and resp.content == b""
    assert resp.headers["content-type"] == get(gateway_url + path).headers["content-type"]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("HEAD", "/v1/chat/completions", "POST"),
        ("PUT", "/tokenize", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("POST", "/v1/models/" + MODEL, "GET, HEAD"),
    ],
)
def test_405_lists_the_allowed_methods(gateway_url: str, method: str, path: str, allow: str) -> None:
    resp = httpx.request(method, gateway_url + path, timeout=5)
    assert resp.status_code == 405 and resp.headers["allow"] == allow
    if method != "HEAD":
        err = assert_error(resp, 405)
        assert method in err["message"] and allow in err["message"]


# ---- usage.spindle ----


def usages(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """usage of the non-streamed and the streamed response."""
    plain = post(url, path, {**body, "stream": False})
    assert plain.status_code == 200, plain.text
    chunks = parse_sse(post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}}).text)
    return [plain.json()["usage"], chunks[-2]["usage"]]


def test_usage_spindle_has_the_same_keys_on_every_response(gateway_url: str, peer: ScriptedPeer) -> None:
    stats = {"transfer_ms": 2.5, "kv_bytes": 4096.0, "decode_ms": 7.0, "preemptions": 1.0, "future_field": 3.0}

    def by_length(spec: RequestSpec) -> list[StreamEvent]:
        return token_events(spec.request_id, peer.answer_tokens()[:3], "length", stats=stats)

    seen = []
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        peer.script = peer.answer_script  # finished by EOS, stats {"decode_ms": 1.5}
        seen += [(u, {"decode_ms": 1.5}) for u in usages(gateway_url, path, body)]
        peer.script = by_length
        seen += [(u, stats) for u in usages(gateway_url, path, body)]
        peer.script = peer.endless_script(" Paris")  # a stop string ends it before any stats
        seen += [(u, None) for u in usages(gateway_url, path, {**body, "stop": ["Paris"]})]
    assert len(seen) == 12
    for u, sent in seen:
        assert tuple(u["spindle"]) == SPINDLE_USAGE_KEYS, u
        if sent is None:
            assert set(u["spindle"].values()) == {None}
        else:
            counts = {k: int(sent.get(k, 0)) for k in ("parked", "preemptions", "csa_dropped_tokens")}
            times = {k: sent.get(k) for k in SPINDLE_USAGE_KEYS if k not in counts}
            times["kv_bytes"] = None if "kv_bytes" not in sent else int(sent["kv_bytes"])
            assert u["spindle"] == {**times, **counts}
    assert seen[2][0]["spindle"]["kv_bytes"] == 4096 and isinstance(seen[2][0]["spindle"]["kv_bytes"], int)
