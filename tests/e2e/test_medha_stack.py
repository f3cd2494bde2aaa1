"""`medha` on the services: one elastic instance is one replica, here a sequence pipeline of two stage processes
(`--spp 2`, Medha's SPP), and the scheduler names each of its iterations (`RunIteration`: adaptive prefill chunks
of several requests beside every running decode), which the instance runs as one `Engine.step_directed` through
both stages. Short prompts that arrive while a long one prefills get their first token before
it does (slack-ordered, prefill-prefill batched chunks), every output equals the single engine's, and every block
comes back, also after a disconnect."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until, write_assumed_profile
from .test_failures import kill_member_mid_stream

pytestmark = pytest.mark.slow

# iterations packed to 0.3 s, deadlines 0.25 s + 3x a prompt's prefill alone, chunks from 32 tokens
STRATEGY = "medha:tpot_slo=0.3,min_chunk=32"


def _profile(tmp_path) -> str:
    """The assumed Eq. 1 at SP 1 (2 ms per prompt token: about twice this machine's) and a decode step; Medha builds
    its mixed-batch predictor from the two (Eq. 7 is unused)."""
    batch = {"1": {"coeffs": [0.05, 1e-3, 1e-8], "fit_error": 0.0}}
    decode = [{"tp": 1, "kvp": 1, "coeffs": [0.02, 0.004, 1e-6], "fit_error": 0.0}]
    return write_assumed_profile(tmp_path, batch, decode, 1.5e9)


@pytest.fixture(scope="module")
def medha_stack(tmp_path_factory):
    profile = _profile(tmp_path_factory.mktemp("medha-profile"))
    s = start_stack(
        tmp_path_factory, "medha", prefill=0, decode=0, elastic=1, elastic_spp=2, strategy=STRATEGY, profile=profile
    )
    try:
        yield s
    finally:
        s.stop()


def test_short_prompts_overtake_a_long_one_and_every_output_equals_the_engine(medha_stack, reference_engine):
    rng = random.Random(23)
    lengths = [3000, 40, 90, 17]  # the long prompt first, the short ones while it prefills
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    want = engine_greedy(reference_engine, prompts, max_tokens=8)
    client = openai.OpenAI(base_url=medha_stack.base_url, api_key="unused")
    got: dict[int, list[str]] = {}
    first_token: dict[int, float] = {}

    def run(i: int) -> None:
        time.sleep(0.0 if i == 0 else 0.6 + 0.1 * i)
        stream = client.completions.create(
            model="smollm2", prompt=prompts[i], max_tokens=8, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens: list[str] = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                first_token.setdefault(i, time.monotonic())
                tokens += chunk.choices[0].logprobs.tokens
        got[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    from spindle_model import Tokenizer, resolve_model

    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    for i in range(len(prompts)):
        assert got.get(i) == [tok.decode([t], skip_special_tokens=False) for t in want[i]], f"prompt {i}"
    # an order, not a time: the long prompt's prefill (~3 s here) is split into chunks the short ones pass
    assert all(first_token[i] < first_token[0] for i in (1, 2, 3)), first_token
    assert wait_until(lambda: no_blocks_held(medha_stack), 5), instance_blocks(medha_stack)


def test_disconnect_while_prefilling_and_n_above_one(medha_stack):
    long_prompt = [random.Random(3).randrange(100, 40000) for _ in range(2000)]
    body = {"model": "smollm2", "prompt": long_prompt, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", medha_stack.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert wait_until(lambda: instance_blocks(medha_stack)["elastic-0"], 10), "the prompt should be in"
    assert wait_until(lambda: no_blocks_held(medha_stack), 10), instance_blocks(medha_stack)
    r = httpx.post(
        medha_stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "n": 2}
    )
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]
    ok = httpx.post(medha_stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_dead_stage_ends_the_stream_with_an_error_and_the_instance_exits(medha_stack):
    """Last in the module: it takes the pipeline down. The leader notices the dead stage at its next send."""
    elapsed = kill_member_mid_stream(medha_stack, "elastic-0-spp1", "elastic-0")
    print(f"\n[spp=2] error event {elapsed:.1f}s after the stage's SIGKILL")
