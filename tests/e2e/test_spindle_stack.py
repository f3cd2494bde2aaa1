"""`spindle` in the real stack (`spindle up --strategy spindle`): an interactive prompt takes the cheapest plan that
meets its deadline, a Batch API job submitted meanwhile waits for an idle prefill instance (admitted without a plan,
placed later from a tick or event, which the services' executor carries out like any plan), and every output equals
the single engine's; every KV block is free afterwards.

The profile makes the plans certain (`test_sp_grow._grow_profile`: SP 1 takes 0.1 s + 10 ms per token, SP 2 1.8 s +
5 ms): the 3,000-token prompt misses the 2 s objective on any plan, so its length-scaled deadline (3x its best
standalone time, 50 s) decides, and the cheapest plan meeting that is one instance (30 s against 2 x 17 s).
With one of two prefill instances busy, the interactive load's reserve (one idle instance) leaves nothing to batch
work until the prompt's prefill ends.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import openai
import pytest

from .conftest import engine_greedy, greedy_text, instance_blocks, start_stack, wait_until
from .test_sp_grow import _grow_profile, _prompts

pytestmark = pytest.mark.slow


def test_spindle_defers_batch_work_and_serves_everything_like_the_engine(
    tmp_path_factory, tmp_path: Path, otlp, reference_engine, tokenizer
) -> None:
    stack = start_stack(
        tmp_path_factory, "spindle", prefill=2, decode=1, strategy="spindle:ttft_slo=2",
        profile=_grow_profile(tmp_path), otlp_endpoint=otlp.endpoint,
    )  # fmt: skip
    try:
        long_ids, _ = _prompts(tokenizer, [3000, 1])
        before = {s.trace_id for s in otlp.spans}
        baseline = wait_until(lambda: instance_blocks(stack), 5)
        assert baseline and not any(baseline.values()), baseline
        got: dict[str, str] = {}
        worker = threading.Thread(target=lambda: got.update(long=greedy_text(stack.base_url, long_ids, 16)))
        worker.start()
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
        questions = ["What is the capital of France?", "Name a primary colour."]
        rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                          "temperature": 0}} for i, q in enumerate(questions)]  # fmt: skip
        assert wait_until(lambda: any(instance_blocks(stack).values()), 20)  # the long prompt is prefilling
        f = client.files.create(file=("q.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                                purpose="batch")  # fmt: skip
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        worker.join(120)
        assert wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", timeout=120)
        done = client.batches.retrieve(batch.id)
        assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
        (ref_long,) = engine_greedy(reference_engine, [long_ids], 16)
        assert got["long"] == tokenizer.decode(ref_long)
        out = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        for i, ref in enumerate(engine_greedy(reference_engine, prompts, 8)):
            assert out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"] == tokenizer.decode(ref)
        assert wait_until(lambda: not any(v for held in instance_blocks(stack).values() for v in held.values()), 10)

        def admitted(spans) -> dict[int, str]:  # prompt tokens -> the prefill instance the admission named
            tokens = {s.trace_id: s.attributes.get("spindle.prompt_tokens") for s in spans
                      if s.name == "scheduler.admit" and s.trace_id not in before}  # fmt: skip
            return {tokens[s.trace_id]: s.attributes.get("spindle.prefill_instance") for s in spans
                    if s.trace_id in tokens and "spindle.prefill_instance" in s.attributes}  # fmt: skip

        otlp.wait_for(lambda spans: len(admitted(spans)) >= 3, timeout=15)
        named = admitted(otlp.spans)
        assert named[len(long_ids)] in ("prefill-0", "prefill-1")  # one instance: the cheapest plan in time
        batch_named = [v for k, v in named.items() if k != len(long_ids)]
        assert batch_named == ["", ""], named  # admitted without a plan: deferred to an idle instance
    finally:
        stack.stop()
