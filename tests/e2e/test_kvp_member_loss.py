"""A KV-parallel group asked by the strategy to scale down, then losing a member (`spindle up --decode-kvp 3
--kvp-tokens 300 --strategy single:kvp_merge_tokens=64`).

A 310-token prompt is placed at [0, 300) and [300, 310) on two members; the strategy merges the 10-token tail
shard into the first holder while it decodes (`ScaleDownKVP`, the one time a group moves KV), and its tokens stay
the single engine's. Then a member that holds none of a long split request dies: the long request goes on, exact,
over the two other members; of the short requests the scheduler placed on the dead member, those already decoding
fail with the leader's error, and those whose KV had not arrived yet are placed again by the leader and finish
exact. The scheduler leaves the failing to the leader, which knows where each request's KV is now."""

from __future__ import annotations

import httpx
import pytest

from .conftest import back_in_service, instance_blocks, start_stack, supervise, wait_until
from .sse import stream_text
from .test_failures import kill_mid_stream, read_events_from
from .test_kvp_decode import (
    MEMBER_TOKENS,
    MEMBERS,
    _all_free,
    _greedy_ignoring_eos,
    _holding,
    _instances,
    _prompts,
    kill_member_under_load,
    next_event,
    short_outcomes,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kvp_stack(tmp_path_factory):
    s = start_stack(
        tmp_path_factory, "kvp-loss", prefill=1, decode=1, decode_kvp=3, kvp_tokens=300,
        decode_kv_cache_tokens=MEMBER_TOKENS, strategy="single:kvp_merge_tokens=64",
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def test_the_strategy_merges_a_short_tail_shard_and_the_tokens_stay_exact(kvp_stack, reference_engine, tokenizer):
    ids = _prompts(tokenizer, [310])[0]
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=120, json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next_event(lines)
        assert wait_until(lambda: _instances(kvp_stack)["decode-0"]["counters"]["kvp_scale_downs"] == 1, 30)
        merged = wait_until(lambda: len(_holding(kvp_stack)) == 1, 10)  # one member holds all of its KV now
        holding = _holding(kvp_stack)
        events = [first, *read_events_from(lines)]
    assert merged, holding
    assert events[-1] == "[DONE]" and stream_text(events, chat=False) == tokenizer.decode(
        _greedy_ignoring_eos(reference_engine, ids, 64)
    )
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)


def test_a_dead_member_without_a_part_of_the_long_request_leaves_it_exact(kvp_stack, reference_engine, tokenizer):
    long_ids, *short_ids = _prompts(tokenizer, [600, 7, 9])  # [0, 300) and [300, 600) on two members
    assert wait_until(lambda: _all_free(kvp_stack), 10), instance_blocks(kvp_stack)
    body = {"model": "smollm2", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    # a follower holding none of the long request
    run = kill_member_under_load(
        kvp_stack, long_ids, short_ids, body, lambda held: next(m for m in MEMBERS if m not in held and m != "decode-0")
    )
    victim, events, results = run.victim, run.events, run.results
    print(f"\n[kvp=3] {run.on_victim} short requests on the killed member {victim}")
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict)), events[-3:]
    assert stream_text(events, chat=False) == tokenizer.decode(_greedy_ignoring_eos(reference_engine, long_ids, 120))
    failed = short_outcomes(run, short_ids, reference_engine, tokenizer)
    assert all("KV-parallel member" in got[-2]["error"]["message"] for got, f in zip(results, failed, strict=True) if f)
    assert wait_until(lambda: _all_free(kvp_stack), 5), instance_blocks(kvp_stack)
    assert wait_until(lambda: victim not in _instances(kvp_stack), 10), list(_instances(kvp_stack))
    counters = _instances(kvp_stack)["decode-0"]["counters"]
    assert counters["kvp_members_gone"] == 1 and counters["kvp_lost_requests"] == sum(failed)


def test_a_dead_leader_fails_its_requests_and_takes_the_group_down_cleanly(kvp_stack, tokenizer):
    """Last in the module: the group's leader (member 0, the only one on NATS) dies mid-decode. The request gets
    the scheduler's error before its deadline, the surviving follower exits (its share of the KV goes with it),
    the group's registry entries expire, and a new request gets a clean 503, not a hang."""
    ids = _prompts(tokenizer, [600])[0]  # [0, 300) and [300, 600) on the two live members
    assert wait_until(lambda: _all_free(kvp_stack), 10), instance_blocks(kvp_stack)
    survivors = [m for m in MEMBERS[1:] if kvp_stack.processes[m].poll() is None]
    assert len(survivors) == 1, survivors  # the previous test killed one follower
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=60, json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        for _ in range(3):  # the first from the prefill instance, the next two from the group: it decodes
            next_event(lines)
        assert wait_until(lambda: len(_holding(kvp_stack)) == 2, 30), instance_blocks(kvp_stack)
        events, elapsed = kill_mid_stream(kvp_stack, "decode-0", lines)
    print(f"\n[kvp=3] error event {elapsed:.1f}s after the leader's SIGKILL")
    assert elapsed < 15
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert "decode instance decode-0 was lost" in events[-2]["error"]["message"], events[-2]
    assert wait_until(lambda: kvp_stack.processes[survivors[0]].poll() is not None, 30), "the follower kept running"
    assert wait_until(lambda: not any(i.startswith("decode") for i in _instances(kvp_stack)), 10)
    r = httpx.post(kvp_stack.base_url + "/completions", timeout=30, json={**body, "max_tokens": 4, "stream": False})
    assert r.status_code == 503 and "no live prefill or decode instance" in r.json()["error"]["message"], r.text


def test_supervised_the_whole_group_comes_back_and_splits_a_request_again(kvp_stack, reference_engine, tokenizer):
    """As under `spindle up`: the dead leader's group restarts as a unit (leader and both followers, the follower
    killed earlier too), its members re-form their pairs on the data plane, and a request split over them is exact.
    Run alone (the group still whole), it kills the leader first, as the test before it does."""
    leader = kvp_stack.processes["decode-0"]
    if leader.poll() is None:
        leader.kill()
        assert wait_until(lambda: all(kvp_stack.processes[m].poll() is not None for m in MEMBERS), 30)
    supervise(kvp_stack)
    back_s = back_in_service(kvp_stack, "decode", 1)
    assert wait_until(lambda: sum(i.startswith("decode") for i in _instances(kvp_stack)) == len(MEMBERS), 30)
    ids = _prompts(tokenizer, [600])[0]  # [0, 300) and [300, 600): two members
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    r = httpx.post(kvp_stack.base_url + "/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode(_greedy_ignoring_eos(reference_engine, ids, 16))
    assert wait_until(lambda: _all_free(kvp_stack), 10), instance_blocks(kvp_stack)
    print(f"[kvp=3] the group was back {back_s:.1f}s after supervision started")
