"""A KV-parallel decode instance (`spindle up --decode-kvp 3 --kvp-tokens 500`) in the real stack: three member
processes of 32 blocks (512 tokens) each behind one registered instance. A 1000-token prompt is split at token 500
(not a block boundary) over two members and, as its tail fills during decode, scales up onto the third (existing KV
stays put); greedy tokens equal the single engine's; closing a stream frees the blocks on every member; a killed
member ends its requests with an error instead of a hang."""

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
    ups = _decode_stats(kvp_stack)["counters"]["kvp_scale_ups"]
    print(f"[kvp=3] scale-ups so far: {ups}")
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


def test_member_sigkill_ends_the_stream_with_an_error(kvp_stack, tokenizer):
    """Last in the module: it takes the KVP instance down."""
    ids = _prompts(tokenizer, [700])[0]
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 800, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", kvp_stack.base_url + "/completions", timeout=60, json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        t0 = time.monotonic()
        kvp_stack.processes["decode-0-kvp1"].send_signal(signal.SIGKILL)
        events = read_events_from(lines)
    elapsed = time.monotonic() - t0
    print(f"\n[kvp=3] error event {elapsed:.1f}s after a member's SIGKILL")
    assert elapsed < 30
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    leader = kvp_stack.processes["decode-0"]
    assert wait_until(lambda: leader.poll() is not None, 15), "the leader kept running without its member"
    assert leader.returncode != 0
