"""`request-sp:grow=C` in the real stack: with prefill-0 busy, a request starts at once on prefill-1 and its
group grows to both instances when prefill-0 is predicted free (history re-balanced to the new member); its
greedy tokens, and those of the request that kept prefill-0 busy, equal the single engine's; prefill-0 enters
the grown chunk only after the first one ended (it waits on its event loop, not on its engine thread)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from .conftest import engine_greedy, greedy_text, instance_blocks, start_stack, wait_until
from .test_sp_stack import _profile

pytestmark = pytest.mark.slow

GROW = 64  # tokens per chunk of the growing plan


def _grow_profile(tmp_path: Path) -> str:
    """`_profile` with assumed prefill times that make the plans below certain: SP 1 takes 0.1 s + 10 ms per
    token; SP 2 half of that per token plus 1.8 s. So the 300-token request takes SP 1 (3.1 s against 3.3 s)
    and the 800-token one, arriving while prefill-0 is predicted busy for r >= 0.74 s more, does best growing:
    floor((r - 0.1) / 0.64) chunks of 64 tokens on prefill-1, the rest on both (7.3 s at r = 2.8 s, against
    8.1 s on prefill-1 alone and 8.6 s waiting for both)."""
    path = Path(_profile(tmp_path))
    data = json.loads(path.read_text())
    data["model"]["prefill"] = {
        "1": {"coeffs": [0.1, 0.01, 0.0, 0.0], "fit_error": 0.0, "history_inferred": False},
        "2": {"coeffs": [1.8, 0.005, 0.0, 0.0], "fit_error": 0.0, "history_inferred": False},
    }
    path.write_text(json.dumps(data))
    return str(path)


def _prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    texts = [
        "The old lighthouse keeper counted the ships that passed each night and wrote their names down. ",
        "In the valley below, the river bent twice around the village before it reached the sea. ",
    ]
    out = []
    for n, text in zip(lengths, texts, strict=True):
        base = tokenizer.encode(text, add_special_tokens=False)
        out.append((base * (n // len(base) + 1))[:n])
    return out


async def _wait_admitted(stack, count: int, timeout: float) -> None:
    """Until the scheduler has `count` requests in flight."""
    from spindle_protocol import subjects
    from spindle_protocol.bus import Bus
    from spindle_protocol.messages import ClusterStatus, StatusQuery

    bus = await Bus.connect(stack.nats_url, "test-sp-grow")
    try:
        deadline = time.monotonic() + timeout
        while True:
            status = await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus)
            if status.num_requests_waiting + status.num_requests_running >= count:
                return
            assert time.monotonic() < deadline, "the first request was never admitted"
            await asyncio.sleep(0.01)
    finally:
        await bus.close()


def test_a_request_starts_on_the_free_instance_and_grows(tmp_path_factory, tmp_path, otlp, reference_engine, tokenizer):
    stack = start_stack(
        tmp_path_factory,
        "sp-grow",
        prefill=2,
        decode=1,
        strategy=f"request-sp:max_sp=2,grow={GROW}",
        profile=_grow_profile(tmp_path),
        otlp_endpoint=otlp.endpoint,
    )
    try:
        busy_ids, grow_ids = _prompts(tokenizer, [300, 800])
        results: dict[str, str] = {}

        def complete(name: str, ids: list[int]) -> None:
            results[name] = greedy_text(stack.base_url, ids)

        before = set(otlp.traces())
        t0 = time.monotonic()
        threads = [threading.Thread(target=complete, args=("busy", busy_ids))]
        threads[0].start()
        asyncio.run(_wait_admitted(stack, 1, 30))  # prefill-0 now computes the 300 tokens (SP 1)
        threads.append(threading.Thread(target=complete, args=("grow", grow_ids)))
        threads[1].start()
        for t in threads:
            t.join(240)
        elapsed = time.monotonic() - t0
        expected = engine_greedy(reference_engine, [busy_ids, grow_ids], 8)
        assert results == {"busy": tokenizer.decode(expected[0]), "grow": tokenizer.decode(expected[1])}, results
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

        def grown_chunks(spans) -> list:
            """The SP chunk spans of the second request (the first ran as a plain prefill, without spindle.sp)."""
            return [
                s
                for s in spans
                if s.trace_id not in before and s.name == "prefill.chunk" and "spindle.sp" in s.attributes
            ]

        try:  # three: the first chunk on one instance, the second on both
            chunks = grown_chunks(otlp.wait_for(lambda spans: len(grown_chunks(spans)) >= 3, timeout=15))
        except TimeoutError:
            chunks = grown_chunks(otlp.spans)
        by_sp = sorted((s.attributes["spindle.sp"], s.attributes["spindle.token_range"]) for s in chunks)
        assert [sp for sp, _ in by_sp] == [1, 2, 2], f"the plan did not grow from 1 to 2 instances: {by_sp}"
        assert len({s.trace_id for s in chunks}) == 1
        (_, first), (_, second), (_, third) = by_sp
        split = int(first.split(":")[1])
        assert first == f"0:{split}" and second == third == f"{split}:800" and split % GROW == 0, by_sp
        grown = [s for s in chunks if s.attributes["spindle.sp"] == 2]
        assert sum(s.attributes["spindle.rebalance_bytes"] for s in grown) > 0  # history moved to the new member
        # the joining member waited for the first chunk off its engine thread and entered only after it ended
        (alone,) = [s for s in chunks if s.attributes["spindle.sp"] == 1]
        assert all(s.start >= alone.end for s in grown), [(s.start - alone.end) / 1e9 for s in grown]
        print(f"\n[grow] chunks {by_sp}; both requests done in {elapsed:.1f}s")
    finally:
        stack.stop()
