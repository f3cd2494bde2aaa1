"""The colocated layout end to end: one elastic instance (`spindle up --elastic 1`, strategy `chunked`) prefills
each prompt a chunk per step beside the running decodes and decodes it in the same engine. Same tokens, logprobs
and choices as the single engine; every block freed on finish, disconnect and abort."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until
from .sampling_check import assert_stream_matches, engine_reference, penalised_body, stream_completion
from .sse import read_events

pytestmark = pytest.mark.slow

CHUNK = 64  # the elastic engine's per-step token budget here: prompts of 65+ tokens take several steps
STORY = "Once upon a time in a land far away, there lived a curious fox who loved to"


@pytest.fixture(scope="module")
def elastic_stack(tmp_path_factory):
    s = start_stack(tmp_path_factory, "elastic", prefill=0, decode=0, elastic=1, strategy=f"chunked:chunk_size={CHUNK}")
    try:
        yield s
    finally:
        s.stop()


def test_the_stack_is_one_elastic_instance(elastic_stack):
    assert elastic_stack.config.chunk_tokens == CHUNK
    assert httpx.get(elastic_stack.url + "/health", timeout=5).json() == {"status": "ok"}
    roles = {
        i["instance_id"]: i["role"] for i in httpx.get(elastic_stack.url + "/v1/spindle/instances").json()["instances"]
    }
    assert roles == {"kvstore-0": "kvstore", "elastic-0": "elastic"}


def test_concurrent_streams_with_chunked_prompts_equal_the_engine(elastic_stack, reference_engine):
    """Prompts shorter than, equal to and many times the chunk arrive together and while others decode: each
    stream's greedy tokens equal the single engine's, and no KV block stays held."""
    rng = random.Random(7)
    lengths = [5, 63, 64, 65, 150, 301, 700, 1500]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    want = engine_greedy(reference_engine, prompts, max_tokens=16)
    got: dict[int, list[int]] = {}
    usage: dict[int, dict] = {}

    def run(i: int) -> None:
        time.sleep(0.15 * i)  # later prompts land while the earlier ones prefill or decode
        body = {"model": "smollm2", "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", elastic_stack.base_url + "/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            events = read_events(r)
        chunks = [e for e in events[:-1] if e.get("choices")]
        got[i] = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
        usage[i] = events[-2]["usage"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    from spindle_model import Tokenizer, resolve_model

    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    for i in range(len(prompts)):
        assert got[i] == [tok.decode([t], skip_special_tokens=False) for t in want[i]], f"prompt {i}"
        assert usage[i]["completion_tokens"] == 16 and usage[i]["prompt_tokens"] == lengths[i]
        assert usage[i]["spindle"]["prefill_ms"] > 0 and usage[i]["spindle"]["transfer_ms"] is None
    assert wait_until(lambda: no_blocks_held(elastic_stack), 5), instance_blocks(elastic_stack)


def test_sampling_logprobs_choices_and_prompt_logprobs_equal_the_engine(elastic_stack, reference_engine, tokenizer):
    from spindle_engine import SamplingParams
    from spindle_engine.sampling_params import choice_seed

    prompt = tokenizer.encode(STORY * 8, add_special_tokens=False)  # > 2 chunks
    assert len(prompt) > 2 * CHUNK
    body = penalised_body(prompt, max_tokens=20, banned=tokenizer.encode(" the", add_special_tokens=False)[0])
    tokens, logprobs = engine_reference(reference_engine, body)
    assert_stream_matches(stream_completion(elastic_stack.base_url, body), tokenizer, tokens, logprobs)

    client = openai.OpenAI(base_url=elastic_stack.base_url, api_key="unused")
    resp = client.completions.create(
        model="smollm2", prompt=prompt, n=3, max_tokens=10, temperature=0.9, seed=77, extra_body={"ignore_eos": True}
    )
    for i in range(3):
        params = SamplingParams(max_tokens=10, temperature=0.9, seed=choice_seed(77, i), ignore_eos=True)
        reference_engine.add_request(f"ref-elastic-n-{i}", prompt, params)
    ref: dict[str, list[int]] = {}
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [c.text for c in resp.choices] == [tokenizer.decode(ref[f"ref-elastic-n-{i}"]) for i in range(3)]
    assert resp.usage.completion_tokens == 30

    echo = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    reference_engine.add_request(
        "ref-elastic-echo", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    )
    ref_prompt = None
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            ref_prompt = ref_prompt or o.prompt_logprobs
    lp = echo.choices[0].logprobs.token_logprobs
    assert lp[0] is None and lp[1 : len(prompt)] == pytest.approx([x.logprob for x in ref_prompt], abs=2e-3)
    assert wait_until(lambda: no_blocks_held(elastic_stack), 5), instance_blocks(elastic_stack)


def test_disconnect_while_decoding_and_while_prefilling_frees_every_block(elastic_stack):
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", elastic_stack.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
        assert instance_blocks(elastic_stack)["elastic-0"], "the request holds blocks while it decodes"
    assert wait_until(lambda: no_blocks_held(elastic_stack), 2), instance_blocks(elastic_stack)

    long_prompt = [random.Random(3).randrange(100, 40000) for _ in range(3000)]  # ~47 chunks: still prefilling
    body = {"model": "smollm2", "prompt": long_prompt, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", elastic_stack.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert wait_until(lambda: instance_blocks(elastic_stack)["elastic-0"], 10), "the prompt should be in"
    assert wait_until(lambda: no_blocks_held(elastic_stack), 2), instance_blocks(elastic_stack)
    ok = httpx.post(elastic_stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_prompts_that_arrive_during_one_step_are_prefilled_in_the_next_together(tmp_path_factory, otlp):
    """Three short prompts that reach the instance while a long prompt's step runs all join the next step. (A NATS
    subscription hands over its messages one at a time; an instance that waited for the engine to take each
    request before reading the next let one new request into each step: the third prompt's first token came
    two steps late.)"""
    s = start_stack(tmp_path_factory, "elastic-admit", prefill=0, decode=0, elastic=1, otlp_endpoint=otlp.endpoint,
                    strategy="chunked:chunk_size=2048")  # fmt: skip
    try:
        otlp.clear()
        rng = random.Random(11)
        long_prompt = [rng.randrange(100, 40000) for _ in range(1800)]  # one step of the whole prompt, about a second
        lengths = (21, 22, 23)  # each short prompt's chunk span is told apart by its token range
        body = {"model": "smollm2", "prompt": long_prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as long_stream:
            assert long_stream.status_code == 200
            assert wait_until(lambda: instance_blocks(s)["elastic-0"], 20), "the long prompt's step should run"

            def short(n: int) -> None:
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
                r = httpx.post(s.base_url + "/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text

            threads = [threading.Thread(target=short, args=(n,)) for n in lengths]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            long_stream.read()
        ranges = {f"0:{n}" for n in lengths}

        def first_chunks(spans) -> dict[str, int]:
            return {
                sp.attributes["spindle.token_range"]: sp.start
                for sp in spans
                if sp.name == "prefill.chunk" and sp.attributes.get("spindle.token_range") in ranges
            }

        otlp.wait_for(lambda spans: len(first_chunks(spans)) == len(lengths), timeout=15)
        starts = first_chunks(otlp.spans)
        assert len(set(starts.values())) == 1, f"the short prompts ran in {len(set(starts.values()))} steps: {starts}"
        assert wait_until(lambda: no_blocks_held(s), 5), instance_blocks(s)
    finally:
        s.stop()
