"""End to end: the scheduler moves a request parked on a busy decode instance to one with room (TransferKV;
`single:move_parked_after_s`), and the request decodes there exactly."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from spindle_protocol.messages import DecodeStarted, TransferDone

from .conftest import engine_greedy, start_slow_decode_stack, start_stack
from .test_preempt import Watcher, _stream, _wait_no_leaks

pytestmark = pytest.mark.slow


def test_a_parked_request_moves_to_the_decode_instance_that_freed_up(tmp_path_factory, reference_engine, tokenizer):
    stack = start_slow_decode_stack(
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
    # behind A; once B is done, the scheduler moves C to decode-1 instead of letting it wait for A. B takes all
    # 16 blocks from its prompt on, so decode-1 never looks freer than decode-0 (which A fills only as it
    # decodes), whether the scheduler counts B's blocks as incoming, planned or reported by a heartbeat
    prompts = {"a": words[:200], "b": words[200:448], "c": words[448:498]}
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


def test_a_preempted_request_moved_to_another_instance_continues_its_stream(
    tmp_path_factory, reference_engine, tokenizer
):
    """A is swapped out on decode-0 (PreemptDecode) behind a parked C, then handed to decode-1 (MoveParked):
    it resumes there from its tokens so far, the stream numbering unbroken, the tokens the reference's."""
    from spindle_protocol import subjects
    from spindle_protocol.messages import MoveParked, MoveReply, PreemptDecode, Preempted, PreemptReply

    stack = start_stack(
        tmp_path_factory,
        "move-preempted",
        prefill=1,
        decode=2,
        max_model_len=256,
        kv_cache_tokens=1024,
        decode_kv_cache_tokens=256,  # 16 blocks per decode instance
    )
    words = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    # A's and B's prompts fill their instances (13 of 16 blocks each), so C's KV cannot land on either
    prompts = {"a": words[:200], "b": words[200:400], "c": words[400:450]}
    max_tokens = {"a": 56, "b": 56, "c": 30}

    async def scenario() -> tuple[Watcher, dict[str, list[str]], dict[str, str], MoveReply]:
        w = await Watcher.start(stack.nats_url)
        texts: dict[str, list[str]] = {k: [] for k in prompts}
        rids: dict[str, str] = {}
        try:
            async with httpx.AsyncClient(timeout=180) as client:
                url = stack.base_url
                tasks = {}
                for key in ("a", "b", "c"):  # admitted in this order: A on decode-0, B on decode-1, C parks
                    tasks[key] = asyncio.create_task(_stream(client, url, prompts[key], max_tokens[key], texts[key]))
                    await asyncio.sleep(0.1)
                parked = lambda: [e for e in w.events if isinstance(e, TransferDone) and e.parked]  # noqa: E731
                # C parks on A's instance; B and C may share a prefill step, so B's decode can start after C parks
                await w.until(lambda: parked() and len(w.started()) >= 2, 60)
                rids["c"] = parked()[0].request_id
                rids["a"], rids["b"] = w.started()[:2]
                home = next(e.instance_id for e in w.of(rids["a"], DecodeStarted))
                other = next(e.instance_id for e in w.of(rids["b"], DecodeStarted))
                assert len(w.tokens(rids["a"])) < max_tokens["a"] - 10, "A should still be decoding"
                _, kvstore, kvstore_rank = await w.cluster()
                reply = await w.bus.request(  # A goes to the kvstore and parks behind C
                    subjects.decode_preempt(home),
                    PreemptDecode(request_id=rids["a"], kvstore_instance=kvstore, kvstore_rank=kvstore_rank),
                    PreemptReply,
                    timeout=30,
                )
                assert reply.accepted, reply
                move = await w.bus.request(
                    subjects.decode_move(home), MoveParked(request_id=rids["a"], dst_instance=other), MoveReply
                )
                await asyncio.wait_for(asyncio.gather(*tasks.values()), 180)
            await _wait_no_leaks(stack, 10)
            return w, texts, rids, move
        finally:
            await w.bus.nc.close()

    try:
        w, texts, rids, move = asyncio.run(scenario())
    finally:
        stack.stop()
    assert move.accepted, move
    rid = rids["a"]
    starts = [e.instance_id for e in w.of(rid, DecodeStarted)]
    assert len(starts) == 2 and starts[0] != starts[1], starts  # resumed on the other instance
    assert len(w.of(rid, Preempted)) == 1
    # C had parked behind A (placement ties go to the lower rank) and got A's blocks when A was swapped out
    assert [e.instance_id for e in w.of(rids["c"], DecodeStarted)] == [starts[0]]
    seqs, n = [], 0
    for e in sorted(w.streams[rid], key=lambda e: e.seq):
        seqs.append((e.seq, n))
        n += len(e.token_ids)
    assert all(seq == want for seq, want in seqs), seqs  # numbering unbroken across the two instances
    expected = engine_greedy(reference_engine, [prompts[k] for k in ("a", "b", "c")], 56)
    for key, ids in zip(("a", "b", "c"), expected, strict=True):
        assert "".join(texts[key]) == tokenizer.decode(ids[: max_tokens[key]]), key
