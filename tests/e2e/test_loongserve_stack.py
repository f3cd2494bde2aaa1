"""`loongserve` on the services, per iteration, with groups of one (`max_dop=1,migrate=0`; replication, §7.4.1's
baseline): the scheduler names every step of two elastic instances (`RunIteration`: prefill batches and decode
batches) and each instance runs it as one `Engine.step_directed`, answering `IterationDone` (groups of several
instances: test_loongserve_groups.py). The official `openai` client gets
the single engine's tokens (greedy and seeded); a disconnect while decoding or prefilling frees every block;
n > 1 is refused with a clear 400."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until, write_assumed_profile

pytestmark = pytest.mark.slow

STRATEGY = "loongserve:max_dop=1,migrate=0"


def _profile(tmp_path) -> str:
    """Eq. 7 and a decode step for SP 1."""
    batch = {"1": {"coeffs": [0.05, 2e-4, 1e-8], "fit_error": 0.0}}
    decode = [{"tp": 1, "kvp": 1, "coeffs": [0.04, 0.01, 1.6e-05], "fit_error": 0.0}]
    return write_assumed_profile(tmp_path, batch, decode, 1.5e9)


@pytest.fixture(scope="module")
def loong_stack(tmp_path_factory):
    profile = _profile(tmp_path_factory.mktemp("loong-profile"))
    s = start_stack(tmp_path_factory, "loongserve", prefill=0, decode=0, elastic=2, strategy=STRATEGY, profile=profile)
    try:
        yield s
    finally:
        s.stop()


def test_concurrent_requests_equal_the_engine_greedy_and_seeded(loong_stack, reference_engine):
    rng = random.Random(11)
    lengths = [5, 64, 300, 900, 40, 1500]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    want = engine_greedy(reference_engine, prompts, max_tokens=12)
    client = openai.OpenAI(base_url=loong_stack.base_url, api_key="unused")
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        time.sleep(0.1 * i)  # later prompts land while earlier ones prefill or decode
        resp = client.completions.create(
            model="smollm2", prompt=prompts[i], max_tokens=12, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        got[i] = resp.choices[0].logprobs.tokens  # type: ignore[union-attr]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    from spindle_model import Tokenizer, resolve_model

    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    for i in range(len(prompts)):
        assert got.get(i) == [tok.decode([t], skip_special_tokens=False) for t in want[i]], f"prompt {i}"
    # seeded sampling: the same draws as the single engine
    from spindle_engine import SamplingParams

    seeded = client.completions.create(
        model="smollm2", prompt=prompts[2], max_tokens=10, temperature=0.9, seed=5, extra_body={"ignore_eos": True}
    )
    reference_engine.add_request(
        "ref-loong-seeded", prompts[2], SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    )
    ref: list[int] = []
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            ref += o.new_token_ids
    assert seeded.choices[0].text == tok.decode(ref)
    assert wait_until(lambda: no_blocks_held(loong_stack), 5), instance_blocks(loong_stack)


def test_both_instances_serve_and_n_above_one_is_refused(loong_stack):
    long_prompt = [random.Random(4).randrange(100, 40000) for _ in range(2500)]
    body = {"model": "smollm2", "prompt": long_prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", loong_stack.base_url + "/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        held = instance_blocks(loong_stack)
        busy = [i for i, reqs in held.items() if reqs]
        assert len(busy) == 1, held  # decoding on the instance that prefilled it (scale-down to one)
        short = httpx.post(
            loong_stack.base_url + "/completions",
            json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
            timeout=60,
        )  # a later prompt takes the idle instance while the long one decodes
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 3
    assert wait_until(lambda: no_blocks_held(loong_stack), 5), instance_blocks(loong_stack)
    r = httpx.post(
        loong_stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "n": 2}
    )
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]


def test_disconnect_while_decoding_and_while_prefilling_frees_every_block(loong_stack):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", loong_stack.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
    assert wait_until(lambda: no_blocks_held(loong_stack), 5), instance_blocks(loong_stack)
    long_prompt = [random.Random(3).randrange(100, 40000) for _ in range(3000)]
    body = {"model": "smollm2", "prompt": long_prompt, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", loong_stack.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
    assert wait_until(lambda: no_blocks_held(loong_stack), 10), instance_blocks(loong_stack)
    ok = httpx.post(loong_stack.base_url + "/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_killed_instance_ends_its_requests_and_the_other_serves_on(loong_stack):
    """Last in this module: it leaves the stack with one elastic instance."""
    import signal

    from .sse import read_events

    body = {"model": "smollm2", "prompt": "Count to a thousand", "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", loong_stack.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        holder = wait_until(lambda: next((i for i, q in instance_blocks(loong_stack).items() if q), None), 10)
        assert holder, "the request holds blocks while it decodes"
        t0 = time.monotonic()
        loong_stack.processes[holder].send_signal(signal.SIGKILL)

        class _Lines:
            def iter_lines(self):
                return lines

        events = read_events(_Lines())
    assert time.monotonic() - t0 < 10
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    survivors = wait_until(lambda: [i for i in instance_blocks(loong_stack) if i != holder], 10)
    assert survivors, "the other elastic instance should still report"

    def holder_seen_dead() -> bool:  # until then a new iteration may still name it (see the README's limits)
        r = httpx.get(loong_stack.url + "/health", timeout=5)
        return r.status_code == 200 and holder in r.json().get("missing", [])

    assert wait_until(holder_seen_dead, 10), "the scheduler should see the killed instance dead"
    hi = {"model": "smollm2", "prompt": "Hi", "max_tokens": 3}
    ok = wait_until(lambda: httpx.post(loong_stack.base_url + "/completions", json=hi, timeout=60), 10)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
    assert wait_until(lambda: not any(v for i, v in instance_blocks(loong_stack).items() if i != holder), 5)
