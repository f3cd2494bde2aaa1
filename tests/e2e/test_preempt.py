"""End to end: a decoding request preempted to the kvstore (PreemptDecode) resumes exactly, or is aborted
while it waits there, and nothing leaks anywhere."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import httpx
import pytest

from spindle_protocol import subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    ClusterStatus,
    DecodeStarted,
    PreemptDecode,
    Preempted,
    PreemptReply,
    RequestFinished,
    StatusQuery,
    StreamEvent,
    TransferDone,
    WorkerEvent,
)

from .conftest import engine_greedy, instance_blocks, start_slow_decode_stack, start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    # 16 blocks of 16 tokens on the decode instance, so a preempted request can be kept from resuming
    s = start_stack(
        tmp_path_factory,
        "preempt",
        prefill=1,
        decode=1,
        max_model_len=256,
        kv_cache_tokens=1024,
        decode_kv_cache_tokens=256,
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def words(tokenizer):
    return tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30, add_special_tokens=False)


class Watcher:
    """Worker events and every request's token stream, as the test sees them on NATS."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.events: list = []
        self.streams: dict[str, list[StreamEvent]] = defaultdict(list)

    @classmethod
    async def start(cls, nats_url: str) -> Watcher:
        w = cls(await Bus.connect(nats_url, "test-preempt"))
        await w.bus.subscribe(subjects.EVENTS, WorkerEvent, w._on_event)
        await w.bus.subscribe(f"{subjects.PREFIX}.stream.*", StreamEvent, w._on_stream)
        return w

    async def _on_event(self, msg, raw) -> None:
        self.events.append(msg)

    async def _on_stream(self, msg: StreamEvent, raw) -> None:
        self.streams[msg.request_id].append(msg)

    def of(self, rid: str, kind: type | tuple[type, ...] = object) -> list:
        return [e for e in self.events if e.request_id == rid and isinstance(e, kind)]

    def started(self) -> list[str]:
        return [e.request_id for e in self.events if isinstance(e, DecodeStarted)]

    def tokens(self, rid: str) -> list[int]:
        return [t for e in sorted(self.streams[rid], key=lambda e: e.seq) for t in e.token_ids]

    async def until(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def cluster(self) -> tuple[str, str, int]:
        """(decode instance id, kvstore instance id, kvstore rank)."""
        status = await self.bus.request(subjects.STATUS, StatusQuery(), ClusterStatus)
        decode = next(i for i in status.instances if i.role == "decode")
        kvstore = next(i for i in status.instances if i.role == "kvstore")
        return decode.instance_id, kvstore.instance_id, kvstore.rank

    async def preempt(self, rid: str, kvstore: str | None = None) -> PreemptReply:
        decode, live_kvstore, rank = await self.cluster()
        kvstore = kvstore or live_kvstore
        return await self.bus.request(
            subjects.decode_preempt(decode),
            PreemptDecode(request_id=rid, kvstore_instance=kvstore, kvstore_rank=rank),
            PreemptReply,
            timeout=30,
        )


async def _stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, out: list[str], **extra: object
) -> None:
    """Stream a greedy completion; its text pieces go to `out` (kept when the task is cancelled)."""
    body = {
        **extra,
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                out.extend(c["text"] for c in event["choices"])


def _no_leaks(stack) -> bool:
    return not any(instance_blocks(stack).values())


async def _wait_no_leaks(stack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(_no_leaks, stack):
        assert time.monotonic() < deadline, instance_blocks(stack)
        await asyncio.sleep(0.1)


def test_preempted_request_resumes_exactly(small_stack, reference_engine, tokenizer, words):
    prompt = words[:60]

    async def scenario() -> tuple[list[str], Watcher, str, list[PreemptReply]]:
        w = await Watcher.start(small_stack.nats_url)
        try:
            unknown = await w.preempt("no-such-request")
            text: list[str] = []
            async with httpx.AsyncClient(timeout=120) as client:
                task = asyncio.create_task(_stream(client, small_stack.base_url, prompt, 48, text))
                await w.until(lambda: w.started(), 60)
                rid = w.started()[0]
                await w.until(lambda: len(w.tokens(rid)) >= 4, 30)
                failed = await w.preempt(rid, kvstore="no-such-kvstore")  # nobody stores it: back into the batch
                await w.until(lambda: len(w.tokens(rid)) >= 6, 30)
                reply = await w.preempt(rid)
                await asyncio.wait_for(task, 120)
            await w.until(lambda: w.of(rid, RequestFinished), 10)
            after = await w.preempt(rid)  # finished: unknown
            await _wait_no_leaks(small_stack, 5)
            return text, w, rid, [unknown, failed, reply, after]
        finally:
            await w.bus.nc.close()

    text, w, rid, (unknown, failed, reply, after) = asyncio.run(scenario())
    assert not unknown.accepted and unknown.reason == "unknown"
    assert not failed.accepted and failed.reason.startswith("kvstore_failed"), failed
    assert not after.accepted and after.reason == "unknown"
    assert reply.accepted, reply
    expected = engine_greedy(reference_engine, [prompt], 48)[0]
    # the stream goes on as if nothing happened: contiguous numbering, the reference engine's tokens
    seqs, n = [], 0
    for e in sorted(w.streams[rid], key=lambda e: e.seq):
        seqs.append((e.seq, n))
        n += len(e.token_ids)
    assert all(seq == want for seq, want in seqs), seqs
    assert w.tokens(rid) == expected
    assert "".join(text) == tokenizer.decode(expected)
    kinds = [type(e) for e in w.of(rid, (DecodeStarted, Preempted, RequestFinished))]
    assert kinds == [DecodeStarted, Preempted, DecodeStarted, RequestFinished], kinds
    (pre,) = w.of(rid, Preempted)
    # prompt + outputs so far, less the last output (it has no KV yet)
    assert pre.num_tokens == reply.num_tokens and 6 <= pre.num_tokens - len(prompt) + 1 < 48
    assert w.of(rid, RequestFinished)[0].num_output_tokens == 48


def test_a_constrained_request_preempted_mid_output_resumes_in_its_grammar(
    small_stack, reference_engine, tokenizer, words
):
    """The grammar's state is rebuilt from the outputs when the request resumes from the kvstore: the text still
    matches the regex and equals the single engine's."""
    from spindle_engine import SamplingParams

    from .sampling_check import WORDS_REGEX, engine_tokens

    prompt = words[:60]

    async def scenario() -> tuple[list[str], PreemptReply, list[type]]:
        w = await Watcher.start(small_stack.nats_url)
        try:
            text: list[str] = []
            async with httpx.AsyncClient(timeout=120) as client:
                stream = _stream(client, small_stack.base_url, prompt, 48, text, guided_regex=WORDS_REGEX)
                task = asyncio.create_task(stream)
                await w.until(lambda: w.started(), 60)
                rid = w.started()[0]
                await w.until(lambda: len(w.tokens(rid)) >= 6, 30)
                reply = await w.preempt(rid)
                await asyncio.wait_for(task, 120)
            await w.until(lambda: w.of(rid, RequestFinished), 10)
            await _wait_no_leaks(small_stack, 5)
            return text, reply, [type(e) for e in w.of(rid, (DecodeStarted, Preempted, RequestFinished))]
        finally:
            await w.bus.nc.close()

    text, reply, kinds = asyncio.run(scenario())
    assert reply.accepted, reply
    assert kinds == [DecodeStarted, Preempted, DecodeStarted, RequestFinished], kinds
    params = SamplingParams(max_tokens=48, temperature=0, grammar=("regex", WORDS_REGEX))
    expected = engine_tokens(reference_engine, prompt, params)
    assert "".join(text) == tokenizer.decode(expected)
    assert len("".join(text).split()) == 24 and "".join(text).endswith(".")


def test_abort_while_preempted_frees_everything(small_stack, reference_engine, tokenizer, words):
    # B holds most of the decode pool, C waits parked by the prefill instance; preempting A lets C in,
    # and then A's blocks are not free: A waits in the kvstore until the client goes away.
    prompt_b, prompt_a, prompt_c = words[:100], words[100:140], words[140:240]

    async def scenario() -> tuple[Watcher, dict[str, str], dict[str, list[str]], PreemptReply, dict]:
        w = await Watcher.start(small_stack.nats_url)
        texts: dict[str, list[str]] = {"a": [], "b": [], "c": []}
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                url = small_stack.base_url
                tb = asyncio.create_task(_stream(client, url, prompt_b, 100, texts["b"]))
                await w.until(lambda: len(w.started()) == 1, 60)
                rid_b = w.started()[0]
                ta = asyncio.create_task(_stream(client, url, prompt_a, 48, texts["a"]))
                await w.until(lambda: len(w.started()) == 2, 60)
                rid_a = w.started()[1]
                await w.until(lambda: len(w.tokens(rid_a)) >= 3, 30)
                tc = asyncio.create_task(_stream(client, url, prompt_c, 8, texts["c"]))
                parked = lambda: [e for e in w.events if isinstance(e, TransferDone) and e.parked]  # noqa: E731
                await w.until(parked, 60)
                rid_c = parked()[0].request_id
                reply = await w.preempt(rid_a)
                blocks = await asyncio.to_thread(instance_blocks, small_stack)
                ta.cancel()  # the client goes away while A waits in the kvstore
                with pytest.raises(asyncio.CancelledError):
                    await ta
                await asyncio.wait_for(asyncio.gather(tb, tc), 120)
            await _wait_no_leaks(small_stack, 5)
            return w, {"a": rid_a, "b": rid_b, "c": rid_c}, texts, reply, blocks
        finally:
            await w.bus.nc.close()

    w, rids, texts, reply, blocks = asyncio.run(scenario())
    assert reply.accepted, reply
    rid_a = rids["a"]
    assert rid_a not in blocks["decode-0"] and rid_a in blocks["kvstore-0"], blocks  # it was parked
    kinds = [type(e) for e in w.of(rid_a, (DecodeStarted, Preempted, RequestFinished))]
    assert kinds == [DecodeStarted, Preempted], kinds  # never resumed, never finished
    expected_b, expected_c = engine_greedy(reference_engine, [prompt_b, prompt_c], 100)
    assert "".join(texts["b"]) == tokenizer.decode(expected_b)
    assert "".join(texts["c"]) == tokenizer.decode(expected_c[:8])


@pytest.fixture(scope="module")
def sliced_stack(tmp_path_factory):
    # the scheduler's own policy: a request parked for 0.5 s swaps out one that has decoded for 0.5 s
    s = start_slow_decode_stack(
        tmp_path_factory,
        "time-slice",
        prefill=1,
        decode=1,
        max_model_len=256,
        kv_cache_tokens=1024,
        decode_kv_cache_tokens=256,
        strategy="single:preempt_after_s=0.5",
    )
    try:
        yield s
    finally:
        s.stop()


def test_scheduler_time_slices_a_full_decode_instance(sliced_stack, reference_engine, tokenizer, words):
    # A (150-token prompt) fills most of the 16-block pool, so B parks; the scheduler then swaps them in turn
    prompt_a, prompt_b = words[:150], words[150:250]

    async def scenario() -> tuple[Watcher, dict[str, list[str]]]:
        w = await Watcher.start(sliced_stack.nats_url)
        texts: dict[str, list[str]] = {"a": [], "b": []}
        try:
            async with httpx.AsyncClient(timeout=180) as client:
                url = sliced_stack.base_url
                ta = asyncio.create_task(_stream(client, url, prompt_a, 60, texts["a"]))
                await w.until(lambda: len(w.started()) == 1, 60)
                tb = asyncio.create_task(_stream(client, url, prompt_b, 60, texts["b"]))
                await asyncio.wait_for(asyncio.gather(ta, tb), 180)
            await _wait_no_leaks(sliced_stack, 10)
            return w, texts
        finally:
            await w.bus.nc.close()

    w, texts = asyncio.run(scenario())
    preempted = [e for e in w.events if isinstance(e, Preempted)]
    assert preempted, "the scheduler never preempted"
    assert any(e.parked for e in w.events if isinstance(e, TransferDone)), "B should have parked first"
    expected_a, expected_b = engine_greedy(reference_engine, [prompt_a, prompt_b], 60)
    assert "".join(texts["a"]) == tokenizer.decode(expected_a)
    assert "".join(texts["b"]) == tokenizer.decode(expected_b)
    for rid in {e.request_id for e in preempted}:
        kinds = [type(e) for e in w.of(rid, (DecodeStarted, Preempted, RequestFinished))]
        # every swap-out is followed by a resume, and the request ends once
        assert kinds.count(Preempted) == kinds.count(DecodeStarted) - 1 and kinds[-1] is RequestFinished, kinds
