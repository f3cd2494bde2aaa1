"""Seesaw on the services (`spindle up --strategy seesaw`: one re-sharding group of two processes, PP2 for prefill,
TP2 for decode, its own host KV tier): a batch of 40 requests through the official `openai` client's Batch API
completes with the single engine's tokens, the group switches both ways (the `reshard` spans in the trace,
`spindle:reshards_total` in the metrics), the job's progress is visible while it runs, and nothing is left held."""

from __future__ import annotations

import io
import json
import re
import time

import httpx
import openai
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until

pytestmark = pytest.mark.slow

TIER_TOKENS = 1200  # the batch runner's 16 lines in flight fit; the decodes still running go back beside new prompts


def test_a_batch_of_40_switches_both_ways_and_gives_the_engines_tokens(tmp_path_factory, reference_engine, tokenizer,
                                                                        otlp):  # fmt: skip
    stack = start_stack(tmp_path_factory, "seesaw", prefill=0, decode=0, elastic=1, strategy="seesaw",
                        elastic_reshard="PP2:TP2", host_kv_tokens=TIER_TOKENS, otlp_endpoint=otlp.endpoint)  # fmt: skip
    try:
        assert sorted(n for n in stack.processes if n.startswith("elastic")) == ["elastic-0", "elastic-0-member1"]
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
        questions = [f"Question {i}: what comes after {i * 7}? Answer in one word." for i in range(40)]
        rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 6 + i % 5,
                          "temperature": 0}} for i, q in enumerate(questions)]  # fmt: skip
        f = client.files.create(file=("q.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                                purpose="batch")  # fmt: skip
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        seen: list[tuple[str, int]] = []  # (status, completed) while it runs
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            b = client.batches.retrieve(batch.id)
            seen.append((b.status, b.request_counts.completed if b.request_counts else 0))
            if b.status in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(0.5)
        done = client.batches.retrieve(batch.id)
        print(f"\nprogress seen: {sorted(set(seen), key=lambda s: s[1])}")
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
        assert any(s == "in_progress" and 0 < n < 40 for s, n in seen), seen  # partial progress was visible

        out = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        for n in sorted({6 + i % 5 for i in range(40)}):
            idx = [i for i in range(40) if 6 + i % 5 == n]
            for i, ref in zip(idx, engine_greedy(reference_engine, [prompts[i] for i in idx], n), strict=True):
                got = out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"]
                assert got == tokenizer.decode(ref), (i, got, tokenizer.decode(ref))

        metrics = httpx.get(stack.url + "/metrics", timeout=5).text
        switches = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'spindle:reshards_total\{model_name="smollm2",to="(\w+)"\} ([\d.]+)', metrics)
        }
        print(f"re-shards: {switches}")  # fmt: skip
        assert switches.get("TP2", 0) >= 1 and switches.get("PP2", 0) >= 1, metrics  # both directions
        spans = lambda: [s for s in otlp.spans if s.name == "reshard"]  # noqa: E731
        assert wait_until(lambda: {s.attributes.get("spindle.reshard.to") for s in spans()} >= {"TP2", "PP2"}, 15)
        group = next(i for i in httpx.get(stack.url + "/v1/spindle/instances", timeout=5).json()["instances"]
                     if i["instance_id"] == "elastic-0")  # fmt: skip
        counters = group["counters"]
        print(f"group: {counters}")
        assert counters["prefilled"] == 40 and counters["onboarded"] == 40 + counters["parked"]
        assert counters["reshards"] == sum(switches.values())
        assert counters["tier_bytes_in"] == counters["tier_bytes_out"] > 0
        assert counters["parked"] > 0  # decodes still running went back to the tier before a switch to prefill
        assert wait_until(lambda: no_blocks_held(stack), 10), instance_blocks(stack)
        assert instance_blocks(stack)["elastic-0-host"] == {}  # the tier is empty too

        # a prompt the tier cannot hold is the client's mistake, said as such
        body = {"model": "smollm2", "prompt": [100 + i for i in range(TIER_TOKENS + 10)], "max_tokens": 4}
        r = httpx.post(stack.base_url + "/completions", json=body, timeout=30)
        assert r.status_code == 400 and "host KV tier" in r.json()["error"]["message"], r.text
        # a stream the client drops after its first token (the KV then in the tier or decoding) frees everything
        body = {"model": "smollm2", "prompt": "Count to fifty:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert "text" in first
        assert wait_until(lambda: no_blocks_held(stack), 20), instance_blocks(stack)
        assert instance_blocks(stack)["elastic-0-host"] == {}
        r = httpx.post(stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3,
                                                               "temperature": 0}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text  # the group serves on
    finally:
        stack.stop()
