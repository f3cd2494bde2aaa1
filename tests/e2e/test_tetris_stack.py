"""`tetris` (CDSP, chunkwise dynamic sequence parallelism) in the real stack.

With prefill-0 predicted busy with a first request, Tetris's planner (Algorithm 1) gives a second, longer
request a 2-chunk plan: the first chunk on prefill-1 alone (SP 1) for as long as prefill-0 stays busy, the rest
on both (SP 2, the history re-balanced to prefill-0). Its greedy tokens, and the first request's, equal the single
engine's, and every KV block is released. `test_the_profile_makes_the_two_chunk_plan_certain` (fast) checks on
the scheduler core alone that the profile and strategy below give that plan for every arrival delay the stack
may show.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from spindle_policy import RunPrefill, SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.actions import Action
from spindle_policy.latency import LatencyModel
from spindle_policy.profile_data import load_profile
from spindle_protocol.messages import InstanceInfo, Prompt, RequestSpec, Sampling
from spindle_telemetry.testing import OtlpReceiver, ReceivedSpan

from .conftest import engine_greedy, greedy_text, instance_blocks, start_stack, wait_until
from .test_sp_grow import _prompts, _wait_admitted
from .test_sp_stack import _profile

if TYPE_CHECKING:
    from spindle_engine import Engine
    from spindle_launcher.stack import Stack
    from spindle_model import Tokenizer

STRATEGY = "tetris:improvement_rate=0,min_chunk=64,align=16"
ALIGN, MIN_CHUNK = 16, 64
BUSY, LONG = 200, 800  # prompt tokens of the request that keeps prefill-0 busy, and of the one that grows
SP1 = (0.1, 0.01)  # Eq. 1 (a, b) assumed for SP 1 and SP 2 (c = d = 0): SP 2 halves the per-token time
SP2 = (1.3, 0.005)
MAX_DELAY = 1.3  # the latest second arrival (s after the first) that still gets a legal first chunk


def _tetris_profile(tmp_path: Path) -> str:
    """`_profile` with Eq. 1 coefficients that make the plans certain (improvement rate 0):

    - the 200-token request, all instances free: SP 1 takes 0.1 + 2.0 = 2.1 s, SP 2 1.3 + 1.0 = 2.3 s, so it
      runs on prefill-0 alone, which is then predicted busy until 2.1 s after its admission;
    - the 800-token request, arriving r = 2.1 - delay seconds before prefill-0 is free: on prefill-1 alone 8.1 s,
      on both r + 1.3 + 4.0 <= 7.4 s, so the single-chunk group (Algorithm 2) is both instances; the chunk pair
      (1, 2) puts floor((r - 0.1) / 0.01) tokens, rounded down to 16, on prefill-1 (legal from 64 tokens on:
      r >= 0.74 s, delay <= 1.36 s) and the rest on both as soon as prefill-0 is free: at r = 2 s 176 tokens, then
      624 (6.42 s, against 7.3 s on both from the start).
    """
    path = Path(_profile(tmp_path))
    data = json.loads(path.read_text())
    data["model"]["prefill"] = {
        str(s): {"coeffs": [a, b, 0.0, 0.0], "fit_error": 0.0, "history_inferred": False}
        for s, (a, b) in ((1, SP1), (2, SP2))
    }
    path.write_text(json.dumps(data))
    return str(path)


def _predict(sp: int, tokens: int) -> float:
    a, b = SP1 if sp == 1 else SP2
    return a + b * tokens


def _first_chunk(r: float) -> int:
    """Tokens of the SP-1 chunk when prefill-0 is free in `r` seconds (Algorithm 3)."""
    tokens = int((r - SP1[0]) / SP1[1])
    return tokens - tokens % ALIGN


# ---- the plan, on the scheduler core (fast) ----


def _core(latency: LatencyModel) -> SchedulerCore:
    """The stack's instances as the scheduler sees them (ranks as the launcher gives them, one node)."""
    core = SchedulerCore(create_strategy(STRATEGY, latency), SchedulerConfig())
    for iid, role, rank in (("prefill-0", "prefill", 1), ("prefill-1", "prefill", 2), ("decode-0", "decode", 3)):
        info = InstanceInfo(
            instance_id=iid, role=role, rank=rank, pid=0, started_at=0.0, updated_at=0.0, kv_blocks_total=512,
            block_size=16, max_model_len=4096, node="host",
        )  # fmt: skip
        core.on_heartbeat(info)
    return core


def _spec(rid: str, tokens: int, now: float) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt=Prompt(num_tokens=tokens),
        sampling=Sampling(max_tokens=8),
        arrival_time=now,
        deadline=now + 1e9,
    )


def _plan(actions: list[Action]) -> list[tuple[int, int, tuple[str, ...]]]:
    (run,) = [a for a in actions if isinstance(a, RunPrefill)]
    return [(c.start, c.end, c.instances) for c in run.chunks]


def test_the_profile_makes_the_two_chunk_plan_certain(tmp_path: Path) -> None:
    latency = load_profile(_tetris_profile(tmp_path))  # the file the stack's scheduler reads
    for delay in (0.0, 0.01, 0.1, 0.5, 1.0, MAX_DELAY):
        core = _core(latency)
        assert _plan(core.admit(_spec("busy", BUSY, 0.0), 0.0)) == [(0, BUSY, ("prefill-0",))]
        assert core.state.instances["prefill-0"].busy_until(0.0) == pytest.approx(_predict(1, BUSY))  # 2.1 s
        r = _predict(1, BUSY) - delay  # prefill-0's queue when the long request arrives
        split = _first_chunk(r)
        assert MIN_CHUNK <= split < LONG
        actions = core.admit(_spec("long", LONG, delay), delay)
        assert _plan(actions) == [(0, split, ("prefill-1",)), (split, LONG, ("prefill-1", "prefill-0"))], delay
        plan = core.strategy.last_plan  # type: ignore[attr-defined]
        assert plan is not None and [(n, len(g)) for n, g in plan.chunks] == [(split, 1), (LONG - split, 2)]
        ttft = max(r, _predict(1, split)) + _predict(2, LONG - split)
        assert plan.ttft_s == pytest.approx(ttft)
        assert ttft < r + _predict(2, LONG) < _predict(1, LONG)  # growing < both from the start < prefill-1 alone
        for iid in ("prefill-0", "prefill-1"):  # both planned busy until the plan's end
            assert core.state.instances[iid].planned["long"] == pytest.approx(delay + ttft)
    core = _core(latency)  # the case the docstring works through: r = 2 s
    core.admit(_spec("busy", BUSY, 0.0), 0.0)
    actions = core.admit(_spec("long", LONG, 0.1), 0.1)
    assert _plan(actions) == [(0, 176, ("prefill-1",)), (176, LONG, ("prefill-1", "prefill-0"))]
    assert core.strategy.last_plan.ttft_s == pytest.approx(6.42)  # type: ignore[attr-defined]


# ---- the real stack ----


Chunk = tuple[int, str, str | None, ReceivedSpan]  # SP size, token range, instance, span


def _chunk_spans(spans: list[ReceivedSpan], before: set[str]) -> dict[int, list[Chunk]]:
    """New traces' SP chunks by prompt length (spindle.prompt_tokens of scheduler.admit): (sp, token range,
    instance, span) per chunk; the instance is that of the chunk's parent `prefill` span."""
    new = [s for s in spans if s.trace_id not in before]
    tokens = {s.trace_id: s.attributes["spindle.prompt_tokens"] for s in new if s.name == "scheduler.admit"}
    instance = {s.span_id: s.attributes.get("spindle.instance") for s in new if s.name == "prefill"}
    out: dict[int, list[Chunk]] = {}
    for s in new:
        if s.name == "prefill.chunk" and "spindle.sp" in s.attributes and s.trace_id in tokens:
            chunk = (s.attributes["spindle.sp"], s.attributes["spindle.token_range"], instance.get(s.parent_id), s)
            out.setdefault(tokens[s.trace_id], []).append(chunk)
    return {k: sorted(v, key=lambda c: (c[0], c[1], str(c[2]))) for k, v in out.items()}


def _settled(spans: list[ReceivedSpan], before: set[str]) -> bool:
    """The long request's 3 chunk spans (1 + 2 members) with their `prefill` parents, and the busy request's
    `prefill` span, have arrived."""
    chunks = _chunk_spans(spans, before).get(LONG, [])
    busy = {s.trace_id for s in spans if s.name == "scheduler.admit" and s.attributes["spindle.prompt_tokens"] == BUSY}
    busy_prefill = any(s.name == "prefill" and s.trace_id in busy - before for s in spans)
    return len(chunks) >= 3 and all(c[2] is not None for c in chunks) and busy_prefill


@pytest.mark.slow
async def _prefill_nodes(stack: Stack) -> dict[str, str]:
    """The node each prefill instance reports in its heartbeats, as the scheduler sees them."""
    from spindle_protocol import subjects
    from spindle_protocol.bus import Bus
    from spindle_protocol.messages import ClusterStatus, StatusQuery

    bus = await Bus.connect(stack.nats_url, "test-tetris-nodes")
    try:
        status = await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus)
    finally:
        await bus.close()
    return {i.instance_id: i.node for i in status.instances if i.role == "prefill"}


def test_tetris_grows_a_plan_from_the_free_instance_to_both(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    otlp: OtlpReceiver,
    reference_engine: Engine,
    tokenizer: Tokenizer,
) -> None:
    stack = start_stack(
        tmp_path_factory,
        "tetris",
        prefill=2,
        decode=1,
        strategy=STRATEGY,
        profile=_tetris_profile(tmp_path),
        otlp_endpoint=otlp.endpoint,
        prefill_per_node=1,  # two virtual nodes: GetGroup extends across them when the first has no room
    )
    try:
        assert asyncio.run(_prefill_nodes(stack)) == {"prefill-0": "node-0", "prefill-1": "node-1"}
        busy_ids, long_ids = _prompts(tokenizer, [BUSY, LONG])
        baseline = wait_until(lambda: instance_blocks(stack), 5)
        assert baseline and not any(baseline.values()), baseline
        results: dict[str, str] = {}

        def complete(name: str, ids: list[int]) -> None:
            results[name] = greedy_text(stack.base_url, ids)

        before = set(otlp.traces())
        t0 = time.monotonic()
        threads = [threading.Thread(target=complete, args=("busy", busy_ids))]
        threads[0].start()
        asyncio.run(_wait_admitted(stack, 1, 30))  # prefill-0 now computes the 200 tokens, predicted for 2.1 s
        threads.append(threading.Thread(target=complete, args=("long", long_ids)))
        threads[1].start()
        for t in threads:
            t.join(240)
        elapsed = time.monotonic() - t0
        expected = engine_greedy(reference_engine, [busy_ids, long_ids], 8)
        assert results == {"busy": tokenizer.decode(expected[0]), "long": tokenizer.decode(expected[1])}, results
        assert wait_until(lambda: instance_blocks(stack) == baseline, 5), instance_blocks(stack)

        try:
            spans = otlp.wait_for(lambda spans: _settled(spans, before), timeout=15)
        except TimeoutError:
            spans = otlp.spans
        found = _chunk_spans(spans, before)
        assert BUSY not in found, f"the first request should run as a plain prefill on one instance: {found[BUSY]}"
        new = [s for s in spans if s.trace_id not in before]
        admits = {s.attributes["spindle.prompt_tokens"]: s for s in new if s.name == "scheduler.admit"}
        busy_on = {
            s.attributes["spindle.instance"] for s in new if s.name == "prefill" and s.trace_id == admits[BUSY].trace_id
        }
        assert busy_on == {"prefill-0"}, busy_on
        chunks = found.get(LONG, [])
        plan = [(sp, rng, inst) for sp, rng, inst, _ in chunks]
        assert [sp for sp, _, _ in plan] == [1, 2, 2], f"no 2-chunk plan growing from SP 1 to SP 2: {plan}"
        (_, first, alone_on), (_, second, m0), (_, third, m1) = plan
        split = int(first.split(":")[1])
        assert first == f"0:{split}" and second == third == f"{split}:{LONG}", plan
        assert split % ALIGN == 0 and MIN_CHUNK <= split <= _first_chunk(_predict(1, BUSY)), plan  # 64..192
        assert alone_on == "prefill-1" and {m0, m1} == {"prefill-0", "prefill-1"}, plan
        assert len({s.trace_id for *_, s in chunks}) == 1
        # the split is what Algorithm 3 makes of prefill-0's queue when the long request was admitted
        delay = (admits[LONG].start - admits[BUSY].start) / 1e9
        assert split in {_first_chunk(_predict(1, BUSY) - delay + e) for e in (-0.01, 0.0, 0.01)}, (split, delay)
        grown = [s for sp, *_, s in chunks if sp == 2]
        assert sum(s.attributes["spindle.rebalance_bytes"] for s in grown) > 0  # history moved to prefill-0
        (alone,) = [s for sp, *_, s in chunks if sp == 1]
        assert all(s.start >= alone.end for s in grown), [(s.start - alone.end) / 1e9 for s in grown]
        print(f"\n[tetris] plan {plan}; second admitted {delay:.2f}s after the first; both done in {elapsed:.1f}s")
    finally:
        stack.stop()
