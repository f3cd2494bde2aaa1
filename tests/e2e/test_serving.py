"""End to end through the real stack: gateway -> scheduler -> prefill -> KV transfer -> decode -> SSE."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from spindle_gateway.sse import SPINDLE_USAGE_KEYS

from .conftest import MAX_MODEL_LEN, engine_greedy, instance_blocks, no_blocks_held, wait_until
from .sse import read_events, stream_text

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(stack, stream: bool, **extra) -> httpx.Response:
    body = {"model": "smollm2", "messages": PARIS, "max_tokens": 24, "temperature": 0, "stream": stream, **extra}
    return httpx.post(stack.base_url + "/chat/completions", json=body, timeout=120)


def test_paris_stream_equals_nonstream_equals_engine(stack, reference_engine, tokenizer):
    r = _chat(stack, stream=False)
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0

    with httpx.stream(
        "POST",
        stack.base_url + "/chat/completions",
        timeout=120,
        json={
            "model": "smollm2",
            "messages": PARIS,
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as resp:
        assert resp.status_code == 200
        events = read_events(resp)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert stream_text(events, chat=True) == text
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0].get("finish_reason")]
    assert len(finals) == 1
    usage = events[-2]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert usage["choices"] == [] and [usage["usage"][k] for k in counts] == [body["usage"][k] for k in counts]

    prompt = tokenizer.apply_chat_template(PARIS)
    ref = engine_greedy(reference_engine, [prompt], 24)[0]
    assert text == tokenizer.decode(ref)


def test_openai_client_unchanged(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    chat = client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=12, temperature=0)
    streamed = client.chat.completions.create(
        model="smollm2", messages=PARIS, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    comp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == comp.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_tokenize_usage_and_body_limit_on_the_stack(stack, tokenizer):
    tok = httpx.post(stack.base_url + "/tokenize", json={"model": "smollm2", "messages": PARIS}, timeout=30).json()
    assert tok["tokens"] == tokenizer.apply_chat_template(PARIS) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(stack.base_url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert detok["prompt"] == tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    assert client.models.retrieve("smollm2").id == "smollm2"

    decoded = _chat(stack, stream=False).json()["usage"]  # prefill, KV hand-off, decode
    first_only = _chat(stack, stream=False, max_tokens=1).json()["usage"]  # ends on the prefill instance
    assert decoded["prompt_tokens"] == first_only["prompt_tokens"] == tok["count"]
    assert tuple(decoded["spindle"]) == tuple(first_only["spindle"]) == SPINDLE_USAGE_KEYS
    d, p = decoded["spindle"], first_only["spindle"]
    assert d["transfer_ms"] > 0 and d["kv_bytes"] > 0 and d["decode_ms"] > 0 and d["parked"] == d["preemptions"] == 0
    assert d["prefill_ms"] > 0  # the prefill instance's time travels with the KV hand-off
    assert p["prefill_ms"] > 0 and p["transfer_ms"] is None and p["decode_ms"] is None

    huge = b'{"model": "smollm2", "prompt": "' + b"x" * (8 << 20) + b'"}'
    r = httpx.post(stack.base_url + "/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_16_concurrent_streams_match_the_engine(stack, reference_engine, tokenizer):
    story = "Once upon a time in a land far away, there lived a curious fox who"
    base = tokenizer.encode(story, add_special_tokens=False)
    prompts = [(base * (1 + (i * 37) % 60))[: 5 + (i * 211) % 1500] for i in range(16)]

    def one(ids: list[int]) -> list:
        with httpx.stream(
            "POST",
            stack.base_url + "/completions",
            timeout=300,
            json={
                "model": "smollm2",
                "prompt": ids,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as resp:
            assert resp.status_code == 200, resp.read()
            return read_events(resp)

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, prompts))
    expected = engine_greedy(reference_engine, prompts, 12)
    for events, ref in zip(results, expected, strict=True):
        assert events[-1] == "[DONE]"
        assert stream_text(events, chat=False) == tokenizer.decode(ref)
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)


BAD_REQUESTS = [
    ("invalid json", "/chat/completions", b"{not json", 400),
    ("wrong type", "/chat/completions", {"model": "smollm2", "messages": "hi"}, 400),
    ("empty messages", "/chat/completions", {"model": "smollm2", "messages": []}, 400),
    ("max_tokens 0", "/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400),
    ("negative temperature", "/completions", {"model": "smollm2", "prompt": "hi", "temperature": -1}, 400),
    ("top_p > 1", "/completions", {"model": "smollm2", "prompt": "hi", "top_p": 1.5}, 400),
    ("n = 1000", "/completions", {"model": "smollm2", "prompt": "hi", "n": 1000}, 400),
    ("10k stop strings", "/completions", {"model": "smollm2", "prompt": "hi", "stop": ["x"] * 10_000}, 400),
    ("unknown model", "/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    (
        "prompt over the context",
        "/completions",
        {"model": "smollm2", "prompt": [1] * MAX_MODEL_LEN, "max_tokens": 8},
        400,
    ),
    (
        "lone surrogate",
        "/chat/completions",
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
    ),
    ("token id out of range", "/completions", {"model": "smollm2", "prompt": [10**9]}, 400),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_error_json(stack, name, path, body, status):
    t0 = time.monotonic()
    if isinstance(body, bytes):
        r = httpx.post(stack.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(stack.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert time.monotonic() - t0 < 2.0
    if name == "prompt over the context":
        assert str(MAX_MODEL_LEN) in err["message"] and "8" in err["message"]


def test_stack_healthy_after_bad_requests(stack):
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
    assert _chat(stack, stream=False).status_code == 200


def test_disconnect_mid_stream_frees_blocks_everywhere(stack):
    with httpx.stream(
        "POST",
        stack.base_url + "/completions",
        timeout=60,
        json={
            "model": "smollm2",
            "prompt": "Tell me a long story",
            "max_tokens": 2000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ) as resp:
        lines = resp.iter_lines()  # kept open: leaving a for-loop over it would close the response
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
        held = instance_blocks(stack)
        assert any(held.values()), "the request should hold decode blocks while it streams"
    t0 = time.monotonic()
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 1.0), instance_blocks(stack)
    assert time.monotonic() - t0 < 1.0


def test_metrics_exposed(stack):
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    for name in (
        "spindle:time_to_first_token_seconds",
        "spindle:inter_token_latency_seconds",
        "spindle:e2e_request_latency_seconds",
        "spindle:request_queue_time_seconds",
        "spindle:num_requests_running",
        "spindle:num_requests_waiting",
        "spindle:kv_cache_usage_perc",
        "spindle:prompt_tokens_total",
        "spindle:generation_tokens_total",
        "spindle:request_success_total",
    ):
        assert name in text, name


def test_one_trace_per_request_across_services(stack, otlp):
    otlp.clear()
    r = httpx.post(
        stack.base_url + "/completions",
        timeout=60,
        json={"model": "smollm2", "prompt": "Trace me", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200

    services = {"spindle-gateway", "spindle-scheduler", "spindle-prefill", "spindle-decode"}
    names = {
        "gateway.request",
        "scheduler.admit",
        "prefill",
        "prefill.queue",
        "prefill.chunk",
        "kv.transfer",
        "kv.receive",
        "decode",
    }

    def request_trace(spans) -> list:
        """The spans of the one trace whose gateway root is this request's, once every service reported."""
        traces: dict[str, list] = {}
        for sp in spans:
            traces.setdefault(sp.trace_id, []).append(sp)
        for trace in traces.values():
            roots = [sp for sp in trace if sp.parent_id is None]
            if (
                [r.name for r in roots] == ["gateway.request"]
                and services <= {sp.service for sp in trace}
                and (names <= {sp.name for sp in trace})
            ):
                return trace
        return []

    def lost_parents(trace: list) -> list:
        ids = {sp.span_id for sp in trace}
        return [sp.name for sp in trace if sp.parent_id is not None and sp.parent_id not in ids]

    # A child ends (and is exported) before its parent, and each service exports in its own batches: wait until
    # the parents have arrived too, then check that none is missing.
    otlp.wait_for(lambda spans: bool(request_trace(spans)) and not lost_parents(request_trace(spans)), timeout=20)
    trace = request_trace(otlp.spans)
    assert trace, sorted({(sp.service, sp.name, sp.trace_id[:6]) for sp in otlp.spans})
    assert not lost_parents(trace), f"a parent link was lost: {lost_parents(trace)}"


def test_a_batch_through_the_openai_client_gives_the_engines_tokens(stack, reference_engine, tokenizer):
    import io
    import json

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                      "temperature": 0}} for i, q in enumerate(questions)]  # fmt: skip
    rows.append(rows[0] | {"custom_id": "bad", "body": rows[0]["body"] | {"max_tokens": -1}})
    f = client.files.create(file=("q.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", timeout=120)
    done = client.batches.retrieve(batch.id)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    out = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    for i, ref in enumerate(engine_greedy(reference_engine, prompts, 12)):
        assert out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"] == tokenizer.decode(ref)
    err = json.loads(client.files.content(done.error_file_id).text)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert wait_until(lambda: no_blocks_held(stack), timeout=10)
