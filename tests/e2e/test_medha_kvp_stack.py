"""`medha`'s KV parallelism on the services (Medha §3.4): two elastic instances of 1,024 KV tokens each serve a
1,250-token prompt neither can hold. Its first chunks fill one instance; the next run on the other, which attends the
earlier chunks' KV where it stays (a `RunIteration` prefill part with a `master`: `spindle_engine.esp`), and then
masters its decodes, both instances attending each query over their share. Short prompts keep being served beside
it, every output equals the single engine's, and every block comes back on both instances. Run twice: on plain
instances, and on pipeline instances of two stage processes each (Medha's 3D: each stage exchanges its layers'
queries with the same stage of the other instance)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import openai
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until
from .test_medha_stack import _profile as medha_profile

pytestmark = pytest.mark.slow

STRATEGY = "medha:tpot_slo=1.0,min_chunk=64"  # larger chunks than the scheduling test's: fewer group iterations


@pytest.fixture(scope="module", params=[1, 2], ids=["kvp", "kvp-spp2"])
def kvp_stack(tmp_path_factory, request):
    profile = medha_profile(tmp_path_factory.mktemp("medha-kvp-profile"))
    s = start_stack(
        tmp_path_factory, f"medha-kvp-spp{request.param}", prefill=0, decode=0, elastic=2, elastic_spp=request.param,
        strategy=STRATEGY, profile=profile, kv_cache_tokens=1024, max_model_len=2048,
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def test_a_prompt_larger_than_an_instance_spans_two_and_equals_the_engine(kvp_stack, reference_engine):
    rng = random.Random(29)
    lengths = [1250, 60, 150, 33]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    want = engine_greedy(reference_engine, prompts, max_tokens=8)
    client = openai.OpenAI(base_url=kvp_stack.base_url, api_key="unused")
    got: dict[int, list[int]] = {}
    errors: dict[int, str] = {}

    def run(i: int) -> None:
        time.sleep(0.0 if i == 0 else 0.5 * i)
        try:
            resp = client.completions.create(
                model="smollm2", prompt=prompts[i], max_tokens=8, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            got[i] = resp.choices[0].logprobs.tokens  # type: ignore[union-attr]
        except openai.APIError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    from spindle_model import Tokenizer, resolve_model

    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    for i in range(len(prompts)):
        assert got.get(i) == [tok.decode([t], skip_special_tokens=False) for t in want[i]], f"prompt {i}"
    logs = "".join(p.read_text() for p in Path(kvp_stack.config.log_dir).glob("elastic-*.log"))
    assert "(handed over)" in logs  # the second instance took the long prompt's next chunks
    assert wait_until(lambda: no_blocks_held(kvp_stack), 10), instance_blocks(kvp_stack)


def test_a_seeded_penalised_request_spanning_both_equals_the_engine(kvp_stack, reference_engine):
    """Sampling after the spill: the last chunk's master samples the first token, the same member every later one,
    with penalties over the whole output and the request's own seed: the engine's tokens and logprobs."""
    from spindle_model import Tokenizer, resolve_model

    from .sampling_check import assert_stream_matches, engine_reference, penalised_body, stream_completion

    prompt = [random.Random(31).randrange(100, 40000) for _ in range(1150)]
    body = penalised_body(prompt, max_tokens=10, banned=prompt[-1])
    tokens, logprobs = engine_reference(reference_engine, body)
    events = stream_completion(kvp_stack.base_url, body)
    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    assert_stream_matches(events, tok, tokens, logprobs)
    assert wait_until(lambda: no_blocks_held(kvp_stack), 10), instance_blocks(kvp_stack)
