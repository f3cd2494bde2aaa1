"""End to end: the scheduler moves a request parked on a busy decode instance to one with room (TransferKV;
`single:move_parked_after_s`), and the request decodes there exactly."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from spindle_protocol.messages import DecodeStarted, TransferDone

from .conftest import engine_greedy, start_stack
from .test_preempt import Watcher, _stream, _wait_no_leaks

pytestmark = pytest.mark.slow


def test_a_parked_request_moves_to_the_decode_instance_that_freed_up(tmp_path_factory, reference_engine, tokenizer):
    stack = start_stack(
        tmp_path_factory,
        "move-parked",
        prefill=1,
        decode=2,
        max_model_len=256,
        kv_cache_tokens=1024,
        decode_kv_cache_tokens=256,  # 16 blocks per decode instance
        strategy="single:move_parked_after_s=0.3",
    )
    words = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    # A fills decode-0 for a while, B fills decode-1 briefly; C fits on neither when it arrives and parks
    # behind A; once B is done, the scheduler moves C to decode-1 instead of letting it wait for A
    prompts = {"a": words[:200], "b": words[200:400], "c": words[400:450]}
    max_tokens = {"a": 48, "b": 4, "c": 10}

    async def scenario() -> tuple[Watcher, dict[str, list[str]]]:
        w = await Watcher.start(stack.nats_url)
        texts: dict[str, list[str]] = {k: [] for k in prompts}
        try:
            async with httpx.AsyncClient(timeout=180) as client:
                tasks = []
                for key in ("a", "b", "c"):
                    tasks.append(
                        asyncio.create_task(_stream(client, stack.base_url, prompts[key], max_tokens[key], texts[key]))
                    )
                    await asyncio.sleep(0.2)  # admitted in this order
                await asyncio.wait_for(asyncio.gather(*tasks), 180)
            await _wait_no_leaks(stack, 10)
            return w, texts
        finally:
            await w.bus.nc.close()

    try:
        w, texts = asyncio.run(scenario())
    finally:
        stack.stop()
    parked = [e for e in w.events if isinstance(e, TransferDone) and e.parked]
    assert len(parked) == 1, parked  # C, and only C, parked
    rid_c = parked[0].request_id
    (started,) = w.of(rid_c, DecodeStarted)
    assert started.instance_id != parked[0].dst_instance, "C should have decoded where it was moved to"
    expected = engine_greedy(reference_engine, [prompts[k] for k in ("a", "b", "c")], 48)
    for key, ids in zip(("a", "b", "c"), expected, strict=True):
        assert "".join(texts[key]) == tokenizer.decode(ids[: max_tokens[key]]), key
