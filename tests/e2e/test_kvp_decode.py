"""A KV-parallel decode group (`spindle up --decode-kvp 3 --kvp-tokens 500`) in the real stack: three member processes
of 32 blocks (512 tokens) each, each registered as a decode instance of the group. The scheduler places requests
over the members (the strategy gets kvp_tokens=500): a 1000-token prompt is split at token 500 (not a block
boundary) over two members and, as its tail fills during decode, scales up onto the third (existing KV stays put)
and the leader tells the scheduler (KVPShards); greedy tokens equal the single engine's; closing a stream frees the
blocks on every member; a killed member ends its requests with an error within seconds, its registry entry is
withdrawn, and the other requests go on, exact."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from spindle_protocol import Bus
from spindle_protocol.codec import decode
from spindle_protocol.messages import InstanceInfo
from spindle_protocol.registry import registry_bucket

from .conftest import engine_greedy, instance_blocks, start_stack, wait_until
from .sampling_check import assert_stream_matches, engine_reference, penalised_body, stream_completion
from .sse import read_events, stream_text
from .test_failures import kill_mid_stream

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


MEMBERS = ("decode-0", "decode-0-kvp1", "decode-0-kvp2")


def _instances(stack) -> dict[str, dict]:
    r = httpx.get(stack.url + "/v1/spindle/instances", timeout=5)
    r.raise_for_status()
    return {i["instance_id"]: i for i in r.json()["instances"]}


def _decode_stats(stack) -> dict:
    return _instances(stack)["decode-0"]


def _all_free(stack) -> bool:
    return not any(v for held in instance_blocks(stack).values() for v in held.values())


def _holding(stack) -> dict[str, dict[str, int]]:
    """The members holding blocks, with their blocks per request."""
    held = instance_blocks(stack)
    return {m: held[m] for m in MEMBERS if any(held.get(m, {}).values())}


def _heartbeats(stack) -> dict[str, InstanceInfo]:
    """The members' heartbeats in the registry (what the scheduler plans with)."""

    async def read() -> dict[str, InstanceInfo]:
        bus = await Bus.connect(stack.nats_url, "kvp-test")
        try:
            bucket = await registry_bucket(bus)
            return {m: decode((await bucket.get(m)).value, InstanceInfo) for m in MEMBERS}
        finally:
            await bus.close()

    return asyncio.run(read())


def test_registers_each_member_as_a_decode_instance(kvp_stack):
    beats = _heartbeats(kvp_stack)
    assert {m: beats[m].device for m in MEMBERS} == dict.fromkeys(MEMBERS, "cpu")  # the followers' from their joins
    instances = _instances(kvp_stack)
    assert sorted(i for i in instances if i.startswith("decode")) == list(MEMBERS)
    assert all(instances[m]["kv_blocks_total"] == MEMBER_TOKENS // 16 for m in MEMBERS)
    counters = instances["decode-0"]["counters"]
    assert counters["kvp_scale_ups"] == 0
    assert counters["kvp_scale_downs"] == 0  # the scale-down policy is off unless asked for


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
    assert counters["kvp_placed_as_given"] == 2 and counters["kvp_placed_by_group"] == 0  # the scheduler placed both
    # the leader told the scheduler of the scale-up (KVPShards): its view holds the third member too
    log = (Path(kvp_stack.config.log_dir) / "scheduler.log").read_text()
    assert re.search(r"its KV is on 3 members now: \[\('decode-0[^)]*, 0, 500\)", log), log[-3000:]
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)


def test_penalties_and_logprobs_over_a_split_request_equal_the_engine(kvp_stack, reference_engine, tokenizer):
    """A 1000-token prompt split over two members: the master samples with the penalties over the whole history,
    and its logprobs reach the group's leader, which publishes them."""
    ids = _prompts(tokenizer, [1000])[0]
    body = penalised_body(ids, max_tokens=16, banned=tokenizer.encode(" the", add_special_tokens=False)[0])
    tokens, logprobs = engine_reference(reference_engine, body)
    assert_stream_matches(stream_completion(kvp_stack.base_url, body), tokenizer, tokens, logprobs)
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)


def test_guided_regex_over_a_split_request_equals_the_engine(kvp_stack, reference_engine, tokenizer):
    """Constrained decoding on a KVP group: the master of a 1000-token split request masks with the grammar."""
    from spindle_engine import SamplingParams

    from .sampling_check import WORDS_REGEX, engine_tokens

    ids = _prompts(tokenizer, [1000])[0]
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 60, "temperature": 0, "guided_regex": WORDS_REGEX}
    text = stream_text(stream_completion(kvp_stack.base_url, body), chat=False)
    assert len(text.split()) == 24 and text.endswith(".")
    params = SamplingParams(max_tokens=60, temperature=0, grammar=("regex", WORDS_REGEX))
    assert text == tokenizer.decode(engine_tokens(reference_engine, ids, params))
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)


def test_closing_a_stream_frees_blocks_on_every_member(kvp_stack, tokenizer):
    ids = _prompts(tokenizer, [700])[0]  # [0, 500) and [500, 700) on two members
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 800, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=60, json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        holding = _holding(kvp_stack)
        assert len(holding) == 2, holding
        assert sorted(sum(h.values()) for h in holding.values()) == [13, 32], holding
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)


def _greedy_ignoring_eos(engine, ids: list[int], max_tokens: int) -> list[int]:
    from spindle_engine import SamplingParams

    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids if o.request_id == rid else []
    return out


def next_event(lines) -> dict:
    """The stream's next event, skipping SSE blank lines (the first comes from the prefill instance)."""
    line = next(lines)
    while not line.startswith("data: "):
        line = next(lines)
    return json.loads(line.removeprefix("data: "))


@dataclass
class KillRun:
    victim: str
    on_victim: int  # short requests the scheduler had put on the victim
    events: list  # the long stream's, the first included
    elapsed: float  # from the SIGKILL to the long stream's end
    results: list[list]  # each short request's events


def kill_member_under_load(
    stack, long_ids: list[int], short_ids: list[list[int]], body: dict, choose_victim: Callable[[dict], str]
) -> KillRun:
    """Stream the long request; once it decodes, start the short ones (48 tokens each) and, when both decode,
    SIGKILL the member `choose_victim` picks from the members holding the long request's KV."""
    with (
        httpx.stream("POST", stack.base_url + "/completions", timeout=120, json={**body, "prompt": long_ids,
                     "stream": True}) as resp,
        cf.ThreadPoolExecutor(len(short_ids)) as pool,
    ):  # fmt: skip
        lines = resp.iter_lines()
        first = next_event(lines)  # from the prefill instance: the KV may still be on its way
        decoding = next_event(lines)  # from the group: the KV is placed (a member killed before is another case)
        assert wait_until(lambda: len(_holding(stack)) == 2, 30), instance_blocks(stack)
        long_rid = next(iter(next(iter(_holding(stack).values()))))
        victim = choose_victim(_holding(stack))  # only the long request runs yet
        shorts = [pool.submit(_stream, stack, {**body, "max_tokens": 48, "prompt": ids}) for ids in short_ids]

        def short_rids() -> dict[str, str]:  # short request id -> the member holding it
            return {r: m for m, held in _holding(stack).items() for r in held if r != long_rid}

        assert wait_until(lambda: len(short_rids()) == len(short_ids), 60), instance_blocks(stack)  # all decoding
        on_victim = sum(m == victim for m in short_rids().values())  # the freest member takes them, usually
        events, elapsed = kill_mid_stream(stack, victim, lines)
        results = [f.result(timeout=120) for f in shorts]
    return KillRun(victim, on_victim, [first, decoding, *events], elapsed, results)


def short_outcomes(run: KillRun, short_ids: list[list[int]], reference_engine, tokenizer) -> list[bool]:
    """Which short requests failed. Those not on the dead member finish exact; one on it fails, or finishes exact
    where the leader placed it again (a reservation whose KV had not arrived)."""
    exact = [
        stream_text(got, chat=False) == tokenizer.decode(_greedy_ignoring_eos(reference_engine, ids, 48))
        for got, ids in zip(run.results, short_ids, strict=True)
    ]
    failed = ["error" in got[-2] for got in run.results]
    assert all(x != f for x, f in zip(exact, failed, strict=True)), (exact, failed, [got[-3:] for got in run.results])
    assert sum(failed) <= run.on_victim, (failed, run.on_victim)
    return failed


def test_member_sigkill_fails_only_its_requests(kvp_stack, reference_engine, tokenizer):
    """Last in the module: it leaves the group with two members. A 700-token prompt is placed first, split over
    two members ([0, 500) and [500, 700)); the two short ones then go to the freest members (usually the third).
    The SIGKILL of a follower holding part of the long one ends the long stream with an error within seconds; the
    short ones not on it finish with the engine's tokens; the leader, not the scheduler, fails what the dead member
    held; every surviving member frees its blocks; the dead member's registry entry is withdrawn and new requests
    avoid it."""
    long_ids, *short_ids = _prompts(tokenizer, [700, 7, 9])
    body = {"model": "smollm2", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    short_body = {**body, "max_tokens": 48}
    # a follower holding part of the long request
    run = kill_member_under_load(
        kvp_stack, long_ids, short_ids, body, lambda held: next(m for m in held if m != "decode-0")
    )
    victim, events = run.victim, run.events
    print(f"\n[kvp=3] error event {run.elapsed:.1f}s after a member's SIGKILL")
    assert run.elapsed < 10
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert "KV-parallel member" in events[-2]["error"]["message"], events[-2]  # the leader's, not the scheduler's
    failed = short_outcomes(run, short_ids, reference_engine, tokenizer)
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)
    assert kvp_stack.processes["decode-0"].poll() is None, "the leader exited without its member"
    survivor = next(m for m in MEMBERS if m not in (victim, "decode-0"))
    assert kvp_stack.processes[survivor].poll() is None, "the surviving member exited"
    assert wait_until(lambda: victim not in _instances(kvp_stack), 10), list(_instances(kvp_stack))
    counters = _decode_stats(kvp_stack)["counters"]
    assert counters["kvp_members_gone"] == 1 and counters["kvp_lost_requests"] == 1 + sum(failed)
    after = _prompts(tokenizer, [600])  # split over the two live members: [0, 500) and [500, 600)
    events = _stream(kvp_stack, {**short_body, "prompt": after[0]})
    assert stream_text(events, chat=False) == tokenizer.decode(_greedy_ignoring_eos(reference_engine, after[0], 48))
    counters = _decode_stats(kvp_stack)["counters"]
    assert counters["kvp_placed_by_group"] == 0  # every request went where the scheduler placed it
