"""Sequence-parallel prefill in the real stack: `fixed-sp` over 4 prefill instances in SP groups of 2, a plan
whose group grows 1 -> 2 -> 4, and a group member killed mid-chunk."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from .conftest import back_in_service, engine_greedy, instance_blocks, start_stack, supervise, wait_until
from .direct import run_plan

pytestmark = pytest.mark.slow

PASSKEY = "68413"


def _profile(tmp_path) -> str:
    """A latency profile with SP 1 and 2 (SP 2 assumed half of SP 1's time: fixed-sp only ranks groups by it)."""
    coeffs = [0.08, 0.002, 9e-7, 1.2e-6]
    model = {
        "version": 1,
        "source": "test: assumed",
        "prefill": {
            "1": {"coeffs": coeffs, "fit_error": 0.0, "history_inferred": False},
            "2": {"coeffs": [c / 2 for c in coeffs], "fit_error": 0.0, "history_inferred": False},
        },
        "batch_prefill": None,
        "decode": [{"tp": 1, "kvp": 1, "coeffs": [0.04, 0.01, 1.6e-05], "fit_error": 0.0}],
        "transfer": {"latency_s": 0.001, "bandwidth_bytes_per_s": 1.5e9},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": model}))
    return str(path)


def _passkey_prompt(tokenizer) -> list[int]:
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    text = filler * 60 + f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. " + filler * 60
    text += "What is the pass key? The pass key is"
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def passkey(tokenizer, reference_engine) -> tuple[list[int], list[int]]:
    """The passkey prompt and the single engine's 8 greedy tokens for it (both tests serve it)."""
    ids = _passkey_prompt(tokenizer)
    return ids, engine_greedy(reference_engine, [ids], 8)[0]


def test_fixed_sp_serves_a_passkey_prompt_like_single_and_survives_a_dead_member(
    tmp_path_factory, tmp_path, passkey, tokenizer
):
    ids, expected = passkey
    stack = start_stack(
        tmp_path_factory, "sp", prefill=4, decode=1, strategy="fixed-sp:sp=2", profile=_profile(tmp_path)
    )
    try:
        assert 2500 < len(ids) < 4000, len(ids)
        r = httpx.post(
            stack.base_url + "/completions",
            timeout=300,
            json={"model": "smollm2", "prompt": ids, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert PASSKEY in text, text
        assert text == tokenizer.decode(expected), (text, tokenizer.decode(expected))
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

        # -- a plan whose group grows 1 -> 2 -> 4 (history re-balanced twice), sent to the instances directly --
        plan = [(0, 800, ["prefill-0"]), (800, 1800, ["prefill-0", "prefill-1"])]
        plan.append((1800, len(ids), ["prefill-0", "prefill-1", "prefill-2", "prefill-3"]))
        tokens, error, _ = asyncio.run(run_plan(stack, ids, plan, 8))
        assert error is None and tokens == expected, (error, tokens, expected)
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

        # -- a group member dies mid-chunk: the client gets an error, nothing hangs, no block stays held --
        result: dict = {}

        def request() -> None:
            resp = httpx.post(
                stack.base_url + "/completions",
                timeout=300,
                json={"model": "smollm2", "prompt": ids, "max_tokens": 4},
            )
            result["status"], result["body"] = resp.status_code, resp.json()

        t = threading.Thread(target=request)
        t.start()
        # Both groups are idle, so fixed-sp picks the first, (prefill-0, prefill-1); its ~3k-token chunk runs for
        # several seconds here. (Instance stats cannot show it: they are refreshed between engine steps, and an
        # SP chunk holds the engine thread for its whole duration.)
        time.sleep(2.0)
        victim = "prefill-1"
        stack.processes[victim].send_signal(signal.SIGKILL)
        t.join(120)
        assert not t.is_alive(), "the client hung"
        assert result["status"] >= 500, result
        assert "error" in result["body"], result

        def live_blocks() -> dict:
            r = httpx.get(stack.url + "/v1/spindle/instances", timeout=5)
            return {i["instance_id"]: i.get("requests") for i in r.json()["instances"] if i["instance_id"] != victim}

        assert wait_until(lambda: not any(live_blocks().values()), 10), live_blocks()
        print(f"\nafter SIGKILL of {victim}: {result['status']} {result['body']['error']['message']!r}")

        # -- supervised (as `spindle up` is), the member comes back, rejoins the data plane and the group serves --
        supervise(stack)
        back_s = back_in_service(stack, "prefill", 1)
        r = httpx.post(
            stack.base_url + "/completions",
            timeout=300,
            json={"model": "smollm2", "prompt": ids, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tokenizer.decode(expected), r.text
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)
        print(f"{victim} restarted and serving in its SP group again after {back_s:.1f} s")
    finally:
        stack.stop()


def test_request_sp_picks_an_sp_group_and_traces_every_member_chunk(
    tmp_path_factory, tmp_path, otlp, passkey, tokenizer
):
    ids, expected = passkey
    # with SP 2 predicted twice as fast and both instances idle, request-sp runs the prompt on both
    stack = start_stack(
        tmp_path_factory,
        "request-sp",
        prefill=2,
        decode=1,
        strategy="request-sp:max_sp=2",
        profile=_profile(tmp_path),
        otlp_endpoint=otlp.endpoint,
    )
    try:
        before = set(otlp.traces())  # the receiver is shared: other tests' SP chunks are in it too
        r = httpx.post(
            stack.base_url + "/completions",
            timeout=300,
            json={"model": "smollm2", "prompt": ids, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(expected)
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

        def sp_chunks(spans) -> list:
            return [
                s
                for s in spans
                if s.name == "prefill.chunk" and s.attributes.get("spindle.sp") == 2 and s.trace_id not in before
            ]

        spans = otlp.wait_for(lambda spans: len(sp_chunks(spans)) >= 2, timeout=15)
        chunks = sp_chunks(spans)
        assert len({s.trace_id for s in chunks}) == 1, "both members' chunks belong to the request's trace"
        assert sum(s.attributes["spindle.tokens"] for s in chunks) == len(ids)  # each member's shard of the chunk
        assert all(s.attributes["spindle.ring_bytes"] > 0 for s in chunks)
    finally:
        stack.stop()
