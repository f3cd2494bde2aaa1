"""A decode instance of tensor-parallel size 2 (`spindle up --decode-tp 2`) in the real stack, fed by
`request-sp:max_sp=2` with a profile that puts prompts under ~340 tokens on one prefill instance and longer
ones on SP-2 groups (each holder, one or two, sends each decode rank only its KV heads, directly):
the single engine's tokens (greedy and seeded sampling), exactly each rank's heads received by each rank and
nothing forwarded by the leader, blocks freed on every rank, and a follower's death ends its requests with an
error instead of a hang."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from .conftest import back_in_service, engine_greedy, instance_blocks, start_stack, supervise, wait_until
from .sampling_check import assert_stream_matches, engine_reference, penalised_body, stream_completion
from .sse import read_events, stream_text
from .test_failures import kill_member_mid_stream
from .test_sp_grow import _grow_profile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    profile = _grow_profile(tmp_path_factory.mktemp("tp-profile"))  # SP 1: 0.1 s + 10 ms/token; SP 2: 1.8 s + 5
    s = start_stack(
        tmp_path_factory, "tp", prefill=2, decode=1, decode_tp=2, strategy="request-sp:max_sp=2", profile=profile
    )
    try:
        yield s
    finally:
        s.stop()


def _stream(stack, body: dict, timeout: float = 300) -> list:
    with httpx.stream("POST", stack.base_url + "/completions", timeout=timeout, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return read_events(r)


def _prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    base = tokenizer.encode(
        "Once upon a time in a land far away, there lived a curious fox who", add_special_tokens=False
    )
    return [(base * (n // len(base) + 1))[:n] for n in lengths]


def test_greedy_completions_equal_the_engine(tp_stack, reference_engine, tokenizer):
    prompts = _prompts(tokenizer, [100, 1000, 7])
    body = {"model": "smollm2", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: _stream(tp_stack, {**body, "prompt": ids}), prompts))
    print(f"\n[tp=2] {len(prompts)} concurrent greedy completions in {time.monotonic() - t0:.1f}s")
    for events, ref in zip(results, engine_greedy(reference_engine, prompts, 16), strict=True):
        assert events[-1] == "[DONE]"
        assert stream_text(events, chat=False) == tokenizer.decode(ref)
    assert wait_until(lambda: not any(instance_blocks(tp_stack).values()), 5), instance_blocks(tp_stack)


def test_seeded_sampling_equals_the_engine(tp_stack, reference_engine, tokenizer):
    from spindle_engine import SamplingParams

    ids = _prompts(tokenizer, [300])[0]
    events = _stream(
        tp_stack,
        {"model": "smollm2", "prompt": ids, "max_tokens": 24, "temperature": 0.9, "seed": 1234, "ignore_eos": True},
    )
    reference_engine.add_request(
        "seeded", ids, SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True)
    )
    ref: list[int] = []
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            ref += o.new_token_ids
    assert stream_text(events, chat=False) == tokenizer.decode(ref)


def test_penalties_and_logprobs_equal_the_engine(tp_stack, reference_engine, tokenizer):
    """Penalties, logit_bias, min_tokens and logprobs on the TP-2 leader, after an SP-1 and an SP-2 prefill."""
    banned = tokenizer.encode(" the", add_special_tokens=False)[0]
    for ids in _prompts(tokenizer, [300, 700]):
        body = penalised_body(ids, max_tokens=16, banned=banned)
        tokens, logprobs = engine_reference(reference_engine, body)
        assert_stream_matches(stream_completion(tp_stack.base_url, body), tokenizer, tokens, logprobs)


def test_guided_json_equals_the_engine(tp_stack, reference_engine, tokenizer):
    """Constrained decoding on the TP-2 decode instance (every rank masks with the same grammar)."""
    import json

    from spindle_engine import SamplingParams

    from .sampling_check import PERSON_SCHEMA, check_person, engine_tokens

    ids = _prompts(tokenizer, [700])[0]
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 60, "temperature": 0, "guided_json": PERSON_SCHEMA}
    text = stream_text(stream_completion(tp_stack.base_url, body), chat=False)
    check_person(text)
    params = SamplingParams(max_tokens=60, temperature=0, grammar=("json_schema", json.dumps(PERSON_SCHEMA)))
    assert text == tokenizer.decode(engine_tokens(reference_engine, ids, params))


def _tp_counters(stack) -> dict[str, int]:
    r = httpx.get(stack.url + "/v1/spindle/instances", timeout=5)
    r.raise_for_status()
    (decode,) = [i for i in r.json()["instances"] if i["instance_id"] == "decode-0"]
    return {k: v for k, v in decode.get("counters", {}).items() if k.startswith("tp_kv_")}


@pytest.mark.parametrize("n", [501, 200], ids=["two-holders", "one-holder"])
def test_each_rank_receives_only_its_heads_from_the_holders(tp_stack, reference_engine, tokenizer, n):
    from spindle_engine.sp import decode_heads
    from spindle_engine.tp import slice_bytes

    before = _tp_counters(tp_stack)
    ids = _prompts(tokenizer, [n])[0]
    events = _stream(tp_stack, {"model": "smollm2", "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert stream_text(events, chat=False) == tokenizer.decode(engine_greedy(reference_engine, [ids], 6)[0])
    c, dtype = reference_engine.model_config, reference_engine.cache.k.dtype
    grown = {
        f"tp_kv_direct_bytes_tp{t}": slice_bytes(n, c.num_layers, hi - lo, c.head_dim, dtype)
        for t, (lo, hi) in enumerate(decode_heads(c, 2))
    }
    forwarded = before.get("tp_kv_forwarded_bytes", 0)  # the leader forwards no heads of a direct transfer
    want = {k: before.get(k, 0) + v for k, v in grown.items()} | {"tp_kv_forwarded_bytes": forwarded}
    got = wait_until(lambda: (d := _tp_counters(tp_stack)) == want and d, 5)
    print(f"\n[tp=2] direct KV bytes per rank for {n} tokens: {grown}")
    assert got == want, (_tp_counters(tp_stack), want)


def test_disconnect_frees_blocks_on_every_rank(tp_stack):
    body = {"model": "smollm2", "prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", tp_stack.base_url + "/completions", timeout=60, json={**body, "temperature": 0, "stream": True}
    ) as resp:
        lines = resp.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
        held = instance_blocks(tp_stack)["decode-0"]
        assert any(k.startswith("tp-rank-") for k in held), f"the follower's blocks are not reported: {held}"
        assert any(not k.startswith("tp-rank-") for k in held), held
    assert wait_until(lambda: not any(instance_blocks(tp_stack).values()), 3.0), instance_blocks(tp_stack)


def test_follower_sigkill_ends_the_stream_with_an_error(tp_stack):
    """It takes the TP instance down (the next test brings it back)."""
    elapsed = kill_member_mid_stream(tp_stack, "decode-0-tp1", "decode-0")
    print(f"\n[tp=2] error event {elapsed:.1f}s after the follower's SIGKILL")


def test_the_tp_instance_restarts_whole_and_decodes_exactly_again(tp_stack, reference_engine, tokenizer):
    """Supervised (as under `spindle up`), the dead follower's instance restarts as a unit, leader and follower,
    re-forms its pairs on the data plane and decodes the single engine's tokens again."""
    supervise(tp_stack)
    back_s = back_in_service(tp_stack, "decode", 1)
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(tp_stack.base_url + "/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode(engine_greedy(reference_engine, [ids], 16)[0])
    assert wait_until(lambda: not any(instance_blocks(tp_stack).values()), 3.0), instance_blocks(tp_stack)
    print(f"[tp=2] the TP instance was back {back_s:.1f}s after supervision started")
