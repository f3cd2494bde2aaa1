"""A KV-parallel decode instance (`spindle up --decode-kvp 3 --kvp-tokens 500`) in the real stack: three member
processes of 32 blocks (512 tokens) each behind one registered instance. A 1000-token prompt is split at token 500
(not a block boundary) over two members and, as its tail fills during decode, scales up onto the third (existing KV
stays put); greedy tokens equal the single engine's; closing a stream frees the blocks on every member; a killed
member ends its requests with an error within seconds while the other requests go on, exact."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import pytest

from .conftest import engine_greedy, instance_blocks, start_stack, wait_until
from .sse import read_events, stream_text
from .test_failures import read_events_from

pytestmark = pytest.mark.slow

MEMBER_TOKENS = 512  # 32 blocks of 16


@pytest.fixture(scope="module")
def kvp_stack(tmp_path_factory):
    s = start_stack(
        tmp_path_factory, "kvp", prefill=1, decode=1, decode_kvp=3, kvp_tokens=500, decode_kv_cache_tokens=MEMBER_TOKENS
    )
    try:
        yield s
    finally:
        s.stop()


def _prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    base = tokenizer.encode(
        "In the quiet harbour town the lighthouse keeper wrote down every ship", add_special_tokens=False
    )
    return [(base * (n // len(base) + 1))[:n] for n in lengths]


def _stream(stack, body: dict, timeout: float = 300) -> list:
    with httpx.stream("POST", stack.base_url + "/completions", timeout=timeout, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return read_events(r)


def _decode_stats(stack) -> dict:
    r = httpx.get(stack.url + "/v1/spindle/instances", timeout=5)
    r.raise_for_status()
    return next(i for i in r.json()["instances"] if i["instance_id"] == "decode-0")


def test_registers_one_instance_with_every_members_blocks(kvp_stack):
    stats = _decode_stats(kvp_stack)
    assert stats["kv_blocks_total"] == 3 * MEMBER_TOKENS // 16
    assert stats["counters"]["kvp_scale_ups"] == 0
    assert stats["counters"]["kvp_scale_downs"] == 0  # the scale-down policy is off unless asked for


def test_split_prompt_scales_up_and_equals_the_engine(kvp_stack, reference_engine, tokenizer):
    prompts = _prompts(tokenizer, [1000, 7])
    body = {"model": "smollm2", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: _stream(kvp_stack, {**body, "prompt": ids}), prompts))
    print(f"\n[kvp=3] {len(prompts)} concurrent greedy completions in {time.monotonic() - t0:.1f}s")
    for events, ref in zip(results, engine_greedy(reference_engine, prompts, 24), strict=True):
        assert events[-1] == "[DONE]"
        assert stream_text(events, chat=False) == tokenizer.decode(ref)
    counters = _decode_stats(kvp_stack)["counters"]
    ups = counters["kvp_scale_ups"]
    print(f"[kvp=3] scale-ups so far: {ups}, scale-downs {counters['kvp_scale_downs']}")
    assert ups >= 1  # the 1000-token prompt's tail member (500 tokens in all its 32 blocks) fills after 12 tokens
    assert wait_until(lambda: not any(instance_blocks(kvp_stack)["decode-0"].values()), 5), instance_blocks(kvp_stack)


def test_closing_a_stream_frees_blocks_on_every_member(kvp_stack, tokenizer):
    ids = _prompts(tokenizer, [700])[0]  # [0, 500) and [500, 700) on two members
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 800, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=60, json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        held = instance_blocks(kvp_stack)["decode-0"]
        members = [k for k in held if k.startswith("kvp-member-")]
        assert members, f"no follower reports blocks: {held}"
        assert sum(v for k, v in held.items() if not k.startswith("kvp-member-")) >= 700 // 16, held
    assert wait_until(lambda: not any(instance_blocks(kvp_stack)["decode-0"].values()), 5), instance_blocks(kvp_stack)


def _greedy_ignoring_eos(engine, ids: list[int], max_tokens: int) -> list[int]:
    from spindle_engine import SamplingParams

    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids if o.request_id == rid else []
    return out


def test_member_sigkill_fails_only_its_requests(kvp_stack, reference_engine, tokenizer):
    """Last in the module: it leaves the KVP instance with two members. A 700-token prompt is placed first, on
    members 0 and 1 ([0, 500) and [500, 700), mastered by its tail, member 1); two short ones then go to member
    2, the member with the most free blocks (one mastered by 2, one by the leader). Member 1's SIGKILL ends the
    long stream with an error within seconds; the short ones finish with the engine's tokens; every surviving
    member frees its blocks; the group's capacity shrinks to two members and new requests avoid member 1."""
    long_ids, *short_ids = _prompts(tokenizer, [700, 7, 9])
    body = {"model": "smollm2", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    short_body = {**body, "max_tokens": 48}
    with (
        httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=60, json={**body, "prompt": long_ids,
                     "stream": True}) as resp,
        cf.ThreadPoolExecutor(2) as pool,
    ):  # fmt: skip
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        shorts = [pool.submit(_stream, kvp_stack, {**short_body, "prompt": ids}) for ids in short_ids]

        def placed() -> bool:
            held = instance_blocks(kvp_stack)["decode-0"]
            requests = sum(1 for k, v in held.items() if v and not k.startswith("kvp-member-"))
            return requests >= 3 and bool(held.get("kvp-member-1")) and bool(held.get("kvp-member-2"))

        assert wait_until(placed, 60), instance_blocks(kvp_stack)  # member 2 holds the short ones: decoding
        t0 = time.monotonic()
        kvp_stack.processes["decode-0-kvp1"].send_signal(signal.SIGKILL)
        events = read_events_from(lines)
        elapsed = time.monotonic() - t0
        results = [f.result(timeout=120) for f in shorts]
    print(f"\n[kvp=3] error event {elapsed:.1f}s after a member's SIGKILL")
    assert elapsed < 10
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    for got, ids in zip(results, short_ids, strict=True):
        assert got[-1] == "[DONE]"
        assert stream_text(got, chat=False) == tokenizer.decode(_greedy_ignoring_eos(reference_engine, ids, 48))
    assert wait_until(lambda: not any(instance_blocks(kvp_stack)["decode-0"].values()), 5), instance_blocks(kvp_stack)
    assert kvp_stack.processes["decode-0"].poll() is None, "the leader exited without its member"
    assert kvp_stack.processes["decode-0-kvp2"].poll() is None, "the surviving member exited"
    stats = _decode_stats(kvp_stack)
    assert stats["kv_blocks_total"] == 2 * MEMBER_TOKENS // 16
    assert stats["counters"]["kvp_members_gone"] == 1 and stats["counters"]["kvp_lost_requests"] == 1
    after = _prompts(tokenizer, [600])  # split over the two live members: [0, 500) and [500, 600)
    events = _stream(kvp_stack, {**short_body, "prompt": after[0]})
    assert stream_text(events, chat=False) == tokenizer.decode(_greedy_ignoring_eos(reference_engine, after[0], 48))
