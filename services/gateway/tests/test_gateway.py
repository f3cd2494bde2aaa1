"""The real gateway over a real nats-server, driven over HTTP, with the SCRIPTED NATS PEER as scheduler/workers."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

from spindle_protocol.messages import AdmitReply, RequestSpec, StreamEvent

from .scripted_peer import ANSWER, MODEL, ScriptedPeer, healthy_status, token_events, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is"}


def parse_sse(body: str) -> list[Any]:
    """Every event must be exactly `data: <payload>\\n\\n`; returns the JSON payloads and the final "[DONE]"."""
    assert body.endswith("\n\n"), body[-50:]
    out = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        payload = event[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


_http = httpx.Client(timeout=10.0)  # one client: creating one per request costs ~0.1 s (TLS context)


def get(url: str, **kw: Any) -> httpx.Response:
    return _http.get(url, **kw)


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return _http.post(url + path, content=content, headers=headers, **kw)


def assert_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    return err


# ---- requests that must never reach the control plane ----

TEN_K_STOPS = [f"s{i}" for i in range(10_000)]
BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("invalid json", "/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400),
    ("empty body", "/v1/chat/completions", b"", 400),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400),
    ("NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("max_tokens a word", "/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, 400),
    ("temperature a word", "/v1/completions", {**COMPLETION, "temperature": "hot"}, 400),
    ("prompt a number", "/v1/completions", {"model": MODEL, "prompt": 5}, 400),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400),
    ("max_tokens negative", "/v1/completions", {**COMPLETION, "max_tokens": -3}, 400),
    ("max_completion_tokens 0", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400),
    ("temperature < 0", "/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400),
    ("top_p > 1", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400),
    ("top_p 0", "/v1/completions", {**COMPLETION, "top_p": 0}, 400),
    ("top_k < -1", "/v1/completions", {**COMPLETION, "top_k": -7}, 400),
    ("n = 1000", "/v1/chat/completions", {**CHAT, "n": 1000}, 400),
    ("10k stop strings", "/v1/chat/completions", {**CHAT, "stop": TEN_K_STOPS}, 400),
    ("empty stop string", "/v1/completions", {**COMPLETION, "stop": [""]}, 400),
    ("stop token id out of vocab", "/v1/completions", {**COMPLETION, "stop_token_ids": [10**6]}, 400),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-5"}, 404),
    ("prompt ids out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 49152]}, 400),
    (
        "prompt + max_tokens over context",
        "/v1/completions",
        {"model": MODEL, "prompt": [1] * 8000, "max_tokens": 500},
        400,
    ),
    ("prompt fills the context", "/v1/completions", {"model": MODEL, "prompt": [1] * 8192}, 400),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    (
        "lone surrogate in content",
        "/v1/chat/completions",
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
        400,
    ),
    ("lone surrogate in prompt", "/v1/completions", b'{"model": "smollm2", "prompt": "x\\udfff"}', 400),
    ("lone surrogate in stop", "/v1/completions", b'{"model": "smollm2", "prompt": "x", "stop": ["\\ud83d"]}', 400),
    ("lone surrogate in model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 404),
    (
        "image content part",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
    ),
]


@pytest.mark.parametrize(("path", "body", "status"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_rejected_before_the_control_plane(
    gateway_url: str, peer: ScriptedPeer, path: str, body: Any, status: int
) -> None:
    for stream in (False, True):
        if isinstance(body, dict):
            body = {**body, "stream": stream}
        assert_error(post(gateway_url, path, body), status)
    assert peer.admits == []


def test_context_error_names_both_numbers(gateway_url: str, peer: ScriptedPeer) -> None:
    err = assert_error(post(gateway_url, "/v1/completions", {"prompt": [1] * 8000, "max_tokens": 500}), 400)
    assert "8000" in err["message"] and "500" in err["message"] and "8192" in err["message"]
    err = assert_error(post(gateway_url, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 9000}), 400)
    assert "9000" in err["message"] and err["param"] == "max_completion_tokens"
    assert peer.admits == []


def test_unknown_route_and_method_are_error_json(gateway_url: str) -> None:
    assert_error(get(gateway_url + "/v1/nothing"), 404)
    assert_error(get(gateway_url + "/v1/completions"), 405)


# ---- admission failures ----


def test_overload_is_429_with_retry_after(gateway_url: str, peer: ScriptedPeer) -> None:
    peer.admit_reply = AdmitReply(accepted=False, status=429, reason="too many queued requests", retry_after_s=2.5)
    for body in (CHAT, {**CHAT, "stream": True}):
        resp = post(gateway_url, "/v1/chat/completions", body)
        err = assert_error(resp, 429)
        assert resp.headers["retry-after"] == "3"
        assert "too many queued" in err["message"] and err["type"] == "RateLimitError"
    assert len(peer.admits) == 2


def test_no_live_workers_is_503(gateway_url: str, peer: ScriptedPeer) -> None:
    peer.admit_reply = AdmitReply(accepted=False, status=503, reason="no live decode instance")
    assert "no live decode" in assert_error(post(gateway_url, "/v1/completions", COMPLETION), 503)["message"]


def test_no_scheduler_is_503_after_waiting_for_one(harness: Any, peer: ScriptedPeer) -> None:
    # admit_timeout bounds the other way to a 503: a request that gets neither NoResponders nor a reply (seen once in
    # CI, under load: 5.0 s, the default admit_timeout)
    gw = harness.start_gateway(scheduler_wait=0.6, admit_timeout=1.0)
    harness.call(peer.set_admitting(False))
    for body in (COMPLETION, {**COMPLETION, "stream": True}):
        t0 = time.monotonic()
        resp = post(gw.url, "/v1/completions", body)
        assert_error(resp, 503)
        assert "retry-after" in resp.headers and 0.3 < time.monotonic() - t0 < 3
    assert peer.admits == []


def test_a_scheduler_that_comes_back_in_time_admits_the_waiting_request(harness: Any, peer: ScriptedPeer) -> None:
    gw = harness.start_gateway(scheduler_wait=10.0)
    harness.call(peer.set_admitting(False))  # the scheduler is restarting
    timer = threading.Timer(1.0, lambda: harness.call(peer.set_admitting(True)))
    timer.start()
    try:
        resp = post(gw.url, "/v1/completions", COMPLETION)
    finally:
        timer.join()
    assert resp.status_code == 200, resp.text
    assert len(peer.admits) == 1  # asked until one answered, admitted once


def test_admission_timeout_is_503_and_aborts(harness: Any, peer: ScriptedPeer) -> None:
    gw = harness.start_gateway(admit_timeout=0.3)
    peer.admit_reply = None  # the scheduler never answers
    assert_error(post(gw.url, "/v1/chat/completions", CHAT), 503)
    request_id = peer.admits[-1].request_id
    assert wait_until(lambda: peer.aborted(request_id), 1.0)


def test_a_deadline_passing_before_admission_is_504_and_aborts(harness: Any, peer: ScriptedPeer) -> None:
    """The request's own deadline, not the scheduler, ended the wait: a timeout (504), not unavailable (503)."""
    gw = harness.start_gateway(request_timeout=0.3, admit_timeout=5.0)
    peer.admit_reply = None
    resp = post(gw.url, "/v1/chat/completions", CHAT)
    assert_error(resp, 504)
    assert "retry-after" not in resp.headers
    assert wait_until(lambda: peer.aborted(peer.admits[-1].request_id), 1.0)


# ---- the token stream ----


def run_both(url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    plain = post(url, path, {**body, "stream": False})
    assert plain.status_code == 200, plain.text
    streamed = post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    return plain.json(), parse_sse(streamed.text)


def streamed_text(chunks: list[Any], kind: str = "chat") -> str:
    key = (lambda c: c["delta"].get("content") or "") if kind == "chat" else (lambda c: c["text"])
    return "".join(key(choice) for chunk in chunks if isinstance(chunk, dict) for choice in chunk.get("choices", []))


def test_chat_stream_and_non_stream_agree_in_openai_shapes(gateway_url: str, peer: ScriptedPeer) -> None:
    plain, chunks = run_both(gateway_url, "/v1/chat/completions", CHAT)
    n_tokens = len(peer.answer_tokens())
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    assert plain["model"] == MODEL and isinstance(plain["created"], int)
    (choice,) = plain["choices"]
    assert choice["message"] == {"role": "assistant", "content": ANSWER}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0 and choice["logprobs"] is None
    usage = plain["usage"]
    assert usage["completion_tokens"] == n_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + n_tokens
    assert usage["prompt_tokens"] == peer.admits[0].prompt.num_tokens
    assert usage["spindle"]["decode_ms"] == 1.5 and usage["spindle"]["preemptions"] == 0

    assert chunks[-1] == "[DONE]"
    *choice_chunks, usage_chunk, _ = chunks
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == choice_chunks[0]["id"] for c in chunks[:-1])
    assert choice_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("role" not in c["choices"][0]["delta"] for c in choice_chunks[1:])
    assert streamed_text(choice_chunks) == ANSWER
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == usage
    assert all(c["usage"] is None for c in choice_chunks)


def test_completion_stream_and_non_stream_agree(gateway_url: str, peer: ScriptedPeer) -> None:
    plain, chunks = run_both(gateway_url, "/v1/completions", COMPLETION)
    assert plain["object"] == "text_completion" and plain["id"].startswith("cmpl-")
    assert plain["choices"][0]["text"] == ANSWER and plain["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == []
    assert all(c["object"] == "text_completion" for c in chunks[:-1])
    assert streamed_text(chunks[:-2], "completion") == ANSWER
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-2]["usage"] == plain["usage"]


def test_stream_without_include_usage_has_no_usage_chunk(gateway_url: str, peer: ScriptedPeer) -> None:
    chunks = parse_sse(post(gateway_url, "/v1/chat/completions", {**CHAT, "stream": True}).text)
    assert chunks[-1] == "[DONE]"
    assert all(c["choices"] and "usage" not in c for c in chunks[:-1])
    assert streamed_text(chunks) == ANSWER


def test_request_spec_carries_sampling_and_defaults(gateway_url: str, peer: ScriptedPeer) -> None:
    body = {
        **CHAT,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "max_tokens": 20,
        "some_unknown_field": {"x": 1},
        "logprobs": False,
    }
    assert post(gateway_url, "/v1/chat/completions", body).status_code == 200
    assert post(gateway_url, "/v1/chat/completions", CHAT).status_code == 200
    assert post(gateway_url, "/v1/completions", {**COMPLETION, "max_tokens": None}).status_code == 200
    spec, chat_default, completion_default = peer.admits
    s = spec.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop_token_ids, s.ignore_eos, s.max_tokens) == (
        0.5,
        0.9,
        40,
        7,
        [5, 6],
        True,
        20,
    )
    assert spec.request_id.startswith("chatcmpl-") and spec.deadline > spec.arrival_time
    assert chat_default.sampling.temperature == 1.0 and chat_default.sampling.top_k == -1
    assert chat_default.sampling.max_tokens == 8192 - chat_default.prompt.num_tokens
    assert completion_default.sampling.max_tokens == 16
    assert completion_default.prompt.token_ids is not None


def test_token_id_prompt(gateway_url: str, peer: ScriptedPeer) -> None:
    resp = post(gateway_url, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4]})
    assert resp.json()["choices"][0]["text"] == ANSWER
    assert peer.admits[0].prompt.token_ids == [1, 2, 3, 4]


def test_out_of_order_and_repeated_events_are_reassembled(gateway_url: str, peer: ScriptedPeer) -> None:
    def shuffled(spec: RequestSpec) -> list[StreamEvent]:
        events = token_events(spec.request_id, peer.answer_tokens(), per_event=2)
        first, rest = events[0], events[1:]
        random.Random(3).shuffle(rest)
        # the decode instance's tokens overtake the prefill instance's first one; some events come twice
        return [*rest[:3], rest[0], *rest[3:], first, events[1]]

    peer.script = shuffled
    plain, chunks = run_both(gateway_url, "/v1/chat/completions", CHAT)
    assert plain["choices"][0]["message"]["content"] == ANSWER
    assert plain["usage"]["completion_tokens"] == len(peer.answer_tokens())
    assert streamed_text(chunks) == ANSWER


def test_error_event_mid_stream(gateway_url: str, peer: ScriptedPeer) -> None:
    def failing(spec: RequestSpec) -> list[StreamEvent]:
        head = [
            StreamEvent(request_id=spec.request_id, seq=i, token_ids=[t])
            for i, t in enumerate(peer.answer_tokens()[:3])
        ]
        return [*head, StreamEvent(request_id=spec.request_id, seq=3, error="decode instance lost", status=503)]

    peer.script = failing
    chunks = parse_sse(post(gateway_url, "/v1/chat/completions", {**CHAT, "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1] == "[DONE]"
    err = chunks[-2]["error"]
    assert err["code"] == 503 and "decode instance lost" in err["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert_error(post(gateway_url, "/v1/chat/completions", CHAT), 503)
    assert wait_until(lambda: all(peer.aborted(s.request_id) for s in peer.admits), 1.0)


def test_error_before_any_token_has_no_role_chunk(gateway_url: str, peer: ScriptedPeer) -> None:
    peer.script = lambda spec: [StreamEvent(request_id=spec.request_id, seq=0, error="prefill failed", status=500)]
    chunks = parse_sse(post(gateway_url, "/v1/chat/completions", {**CHAT, "stream": True}).text)
    assert chunks[0]["error"]["code"] == 500 and chunks[1:] == ["[DONE]"]


def test_stop_string_ends_the_request_and_aborts(gateway_url: str, peer: ScriptedPeer) -> None:
    endless = peer.endless_script()

    def answer_then_endless(spec: RequestSpec) -> list[StreamEvent]:
        answer = peer.answer_tokens()[:-1]  # no EOS: the workers would go on
        tail = endless(spec)
        head = [StreamEvent(request_id=spec.request_id, seq=i, token_ids=[t]) for i, t in enumerate(answer)]
        return head + [
            StreamEvent(request_id=e.request_id, seq=e.seq + len(answer), token_ids=e.token_ids) for e in tail
        ]

    peer.script = answer_then_endless
    peer.interval = 0.002
    plain, chunks = run_both(gateway_url, "/v1/chat/completions", {**CHAT, "stop": ["Paris", "never"]})
    expected = ANSWER[: ANSWER.index("Paris")]
    assert plain["choices"][0]["message"]["content"] == expected
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["choices"][0]["stop_reason"] == "Paris"
    assert streamed_text(chunks) == expected
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: all(peer.aborted(s.request_id) for s in peer.admits), 1.0)
    assert {a.reason for a in peer.aborts} == {"stop string"}


def test_finish_reason_length_passes_through(gateway_url: str, peer: ScriptedPeer) -> None:
    peer.script = lambda spec: token_events(spec.request_id, peer.answer_tokens()[:3], finish_reason="length")
    plain, chunks = run_both(gateway_url, "/v1/completions", {**COMPLETION, "max_tokens": 3})
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 3
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert peer.aborts == []  # a request that finished normally needs no abort


def test_stream_disconnect_aborts_within_a_second(gateway_url: str, harness: Any, peer: ScriptedPeer) -> None:
    peer.script = peer.endless_script()
    peer.interval = 0.02
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", gateway_url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp,
    ):
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
        next(line for line in lines if line.startswith("data: "))
    closed = time.monotonic()
    assert wait_until(lambda: peer.aborted(request_id), 1.0)
    assert time.monotonic() - closed < 1.0
    assert wait_until(lambda: request_id not in harness.gateway.state.live, 1.0)


def test_non_stream_disconnect_aborts(gateway_url: str, harness: Any, peer: ScriptedPeer) -> None:
    peer.script = peer.endless_script()
    peer.interval = 0.05
    with pytest.raises(httpx.ReadTimeout):
        post(gateway_url, "/v1/completions", {**COMPLETION, "max_tokens": 4000}, timeout=0.5)
    request_id = peer.admits[-1].request_id
    assert wait_until(lambda: peer.aborted(request_id), 1.0)
    assert wait_until(lambda: request_id not in harness.gateway.state.live, 1.0)


def test_deadline_ends_the_request_with_504(harness: Any, peer: ScriptedPeer) -> None:
    # long enough for the admission round trip on a busy machine, so the deadline falls inside the stream
    gw = harness.start_gateway(request_timeout=1.5)
    peer.script = peer.endless_script()
    peer.interval = 0.05
    chunks = parse_sse(post(gw.url, "/v1/chat/completions", {**CHAT, "stream": True}).text)
    assert chunks[-1] == "[DONE]"
    err = chunks[-2]["error"]
    assert err["code"] == 504 and err["type"] == "timeout"
    assert_error(post(gw.url, "/v1/completions", COMPLETION), 504)
    assert wait_until(lambda: len(peer.aborts) == 2, 1.0)
    assert {a.reason for a in peer.aborts} == {"deadline"}


# ---- models, health, metrics, instances ----


def test_models(gateway_url: str) -> None:
    body = get(gateway_url + "/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "spindle"
    assert card["root"] == MODEL and card["max_model_len"] == 8192 and isinstance(card["created"], int)


def test_health_follows_the_cluster(gateway_url: str, peer: ScriptedPeer) -> None:
    assert get(gateway_url + "/health").status_code == 200
    status = healthy_status()
    peer.status = type(status)(
        **{
            **{f: getattr(status, f) for f in status.__struct_fields__},
            "instances": [i for i in status.instances if i.role != "decode"],
        }
    )
    time.sleep(0.6)  # past the status cache
    resp = get(gateway_url + "/health")
    assert resp.status_code == 503 and "decode" in resp.json()["error"]["message"]
    # an instance it has seen is dead (restarting) while the others serve: 200, degraded, naming it
    fields = {f: getattr(status, f) for f in status.__struct_fields__}
    peer.status = type(status)(**{**fields, "dead_instances": ["prefill-1"], "worker_restarts": {"prefill": 2}})
    time.sleep(0.6)
    resp = get(gateway_url + "/health")
    assert resp.status_code == 200 and resp.json() == {"status": "degraded", "missing": ["prefill-1"]}
    restarts = 'spindle:worker_restarts_total{model_name="smollm2",role="prefill"} 2.0'
    assert restarts in get(gateway_url + "/metrics").text
    peer.status = None  # the scheduler stops answering
    time.sleep(0.6)
    assert get(gateway_url + "/health", timeout=5).status_code == 503
    peer.status = healthy_status()
    time.sleep(0.6)
    assert get(gateway_url + "/health").status_code == 200


def test_metrics(gateway_url: str, peer: ScriptedPeer) -> None:
    assert post(gateway_url, "/v1/chat/completions", {**CHAT, "stream": True}).status_code == 200
    time.sleep(0.6)
    text = get(gateway_url + "/metrics").text
    for name in (
        "spindle:time_to_first_token_seconds_bucket",
        "spindle:inter_token_latency_seconds_count",
        "spindle:e2e_request_latency_seconds_sum",
        "spindle:request_queue_time_seconds_count",
        "spindle:num_requests_running",
        "spindle:num_requests_waiting",
        "spindle:kv_cache_usage_perc",
        "spindle:prompt_tokens_total",
        "spindle:generation_tokens_total",
        "spindle:request_success_total",
    ):
        assert name in text, name
    assert f'spindle:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.2' in text  # (10 + 30) / (100 + 100)
    assert f'spindle:num_requests_running{{model_name="{MODEL}"}} 2.0' in text
    assert 'spindle:instance_kv_blocks_used{instance="decode-0",model_name="smollm2",role="decode"} 30.0' in text
    assert f'spindle:request_success_total{{finished_reason="stop",model_name="{MODEL}"}}' in text


def test_instances_endpoint(gateway_url: str, peer: ScriptedPeer) -> None:
    body = get(gateway_url + "/v1/spindle/instances").json()
    by_id = {i["instance_id"]: i for i in body["instances"]}
    assert set(by_id) == {"prefill-0", "decode-0", "kvstore-0"}
    assert by_id["decode-0"] == {
        "instance_id": "decode-0",
        "role": "decode",
        "kv_blocks_total": 100,
        "kv_blocks_used": 0,
        "requests": {},
        "device": "cuda:1",  # from its heartbeat
    }
    peer.status = None
    assert get(gateway_url + "/v1/spindle/instances", timeout=5).status_code == 503


# ---- tracing ----


def test_trace_spans_and_context_over_nats(
    gateway_url: str, peer: ScriptedPeer, tmp_path: Any, monkeypatch: Any
) -> None:
    telemetry = pytest.importorskip("spindle_telemetry")
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("SPINDLE_TRACE_FILE", str(path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    telemetry.setup("spindle-gateway")
    try:
        headers = {"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"}
        assert post(gateway_url, "/v1/chat/completions", {**CHAT, "stream": True}, headers=headers).status_code == 200
        assert post(gateway_url, "/v1/completions", COMPLETION).status_code == 200
    finally:
        telemetry.shutdown()  # flushes
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(peer.admits) == 2
    for spec, headers_seen in zip(peer.admits, peer.admit_headers, strict=True):
        (root,) = [
            s
            for s in spans
            if s["name"] == "gateway.request" and s["attributes"]["spindle.request_id"] == spec.request_id
        ]
        children = {s["name"]: s for s in spans if s["parent_id"] == root["span_id"]}
        assert set(children) == {"gateway.admission", "gateway.stream"}
        assert all(c["trace_id"] == root["trace_id"] for c in children.values())
        # the scheduler would continue this trace: traceparent rode along with the AdmitRequest
        _, trace_id, parent_id, _ = headers_seen["traceparent"].split("-")
        assert trace_id == root["trace_id"] and parent_id == children["gateway.admission"]["span_id"]
        assert root["service"] == "spindle-gateway"
    assert spans and {s["trace_id"] for s in spans if s["attributes"].get("spindle.endpoint") == "chat"} == {
        client_trace
    }


@pytest.mark.parametrize(
    ("status", "message", "cause"),
    [
        (503, "prefill instance prefill-0 was lost", "instance_lost"),
        (500, "KV hand-off failed: nats: no responders available for request", "instance_lost"),
        (503, "the cluster's message bus (nats-server) restarted while this request ran; retry it", "bus_restart"),
        (503, "no scheduler is running; try again later", "scheduler_unavailable"),
        (504, "the request did not finish within its deadline (600 s)", "deadline"),
        (429, "12 requests in flight; try again", "overloaded"),
        (503, "no live prefill or decode instance", "unavailable"),
        (400, "prompt too long", "rejected"),
        (500, "admission failed: KeyError", "internal"),
    ],
)
def test_failure_causes(status: int, message: str, cause: str) -> None:
    from spindle_gateway.metrics import failure_cause

    assert failure_cause(status, message) == cause


def test_a_failed_request_is_counted_by_cause(gateway_url: str, peer: ScriptedPeer) -> None:
    peer.admit_reply = AdmitReply(accepted=False, status=503, reason="no live decode instance")
    post(gateway_url, "/v1/completions", COMPLETION)
    text = get(gateway_url + "/metrics").text
    assert f'spindle:request_failures_total{{cause="unavailable",model_name="{MODEL}"}}' in text
