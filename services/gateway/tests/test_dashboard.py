"""`/dashboard` and `/v1/spindle/timeline`: the live timeline folded from the scheduler's decisions, the workers'
events and the registry's heartbeats (LiveTimeline, pure), then the real gateway following a real nats-server on
which the SCRIPTED NATS PEER publishes those messages, its page drawn by headless Chromium."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from spindle_gateway.live_timeline import LiveTimeline
from spindle_protocol import subjects
from spindle_protocol.codec import encode
from spindle_protocol.messages import (
    Decision,
    DecodeStarted,
    IterationDone,
    PrefillProgress,
    RequestFinished,
    SPChunkSpec,
    TransferDone,
)
from spindle_protocol.registry import registry_bucket
from spindle_telemetry.timeline import decode_json, embedded_timeline
from spindle_telemetry.timeline.browser import drawn, png_facts, run_chromium

from .scripted_peer import ScriptedPeer, instance, wait_until
from .test_gateway import assert_error

CHUNKS = [SPChunkSpec(start=0, end=4096, members=["prefill-0"]),
          SPChunkSpec(start=4096, end=12000, members=["prefill-0", "prefill-1"])]  # fmt: skip


def plan(rid: str = "r0") -> Decision:
    return Decision(t=0.0, strategy="tetris", kind="plan", request_id=rid, text="SP 2 on prefill-0..1",
                    instances=["prefill-0", "prefill-1"], chunks=CHUNKS, decode_instance="decode-0")  # fmt: skip


def progress(rid: str, iid: str, done: int, seconds: float = 0.1) -> PrefillProgress:
    return PrefillProgress(request_id=rid, instance_id=iid, tokens_done=done, tokens_total=12000, chunk_seconds=seconds)


def test_sp_chunks_are_linked_and_decode_batches_tracked() -> None:
    live = LiveTimeline(clock=lambda: 100.0)
    live.on_decision(plan(), 100.0)
    live.on_event(progress("r0", "prefill-0", 4096), 101.0)
    live.on_event(progress("r0", "prefill-1", 12000, 0.5), 101.6)
    live.on_event(progress("r0", "prefill-0", 12000, 0.5), 101.6)
    live.on_event(progress("r1", "prefill-1", 512), 101.8)  # no plan heard: the engine's own chunks
    live.on_event(progress("r1", "prefill-1", 1024), 101.9)
    live.on_event(TransferDone(request_id="r0", src_instance="prefill-0", dst_instance="decode-0", nbytes=1,
                               seconds=0.2), 101.8)  # fmt: skip
    for rid, t in (("r0", 102.0), ("r1", 102.5)):
        live.on_event(DecodeStarted(request_id=rid, instance_id="decode-0"), t)
    live.on_event(RequestFinished(request_id="r0", instance_id="decode-0", finish_reason="length",
                                  num_output_tokens=4), 103.0)  # fmt: skip
    t = live.snapshot(104.0)
    assert t.origin == 100.0 and t.strategy == "tetris" and [d.text for d in t.decisions] == ["SP 2 on prefill-0..1"]
    chunks = sorted((s.instance, s.token_start, s.token_end, s.sp) for s in t.spans if s.kind == "prefill")
    assert chunks == [("prefill-0", 0, 4096, 1), ("prefill-0", 4096, 12000, 2), ("prefill-1", 0, 1024, 1),
                      ("prefill-1", 4096, 12000, 2)]  # fmt: skip  # r1's back-to-back steps: one span
    decode = [(s.start, s.end, s.batch) for s in t.spans if s.kind == "decode"]
    assert decode == [(102.0, 102.5, 1), (102.5, 103.0, 2), (103.0, 104.0, 1)]  # the last one still running
    assert [(s.instance, s.start, s.end) for s in t.spans if s.kind == "transfer"] == [("decode-0", 101.6, 101.8)]


def test_iterations_and_stale_bands() -> None:
    live = LiveTimeline(clock=lambda: 0.0)
    batch = Decision(t=0, strategy="loongserve", kind="iteration", request_id="r0", instances=["e0", "e1"], batch_id=7,
                     prefill_requests=["r0"], new_requests=["r0"], decode_masters={"e0": 3})  # fmt: skip
    live.on_decision(batch, 1.0)
    live.on_event(progress("r0", "e0", 4096), 1.4)  # drawn from the iteration instead
    live.on_event(IterationDone(instance_id="e0", batch_id=7, seconds=0.5), 1.5)
    spans = live.snapshot(2.0).spans
    assert sorted((s.instance, s.kind, s.sp, s.batch) for s in spans) == [
        ("e0", "decode", 1, 3), ("e0", "prefill", 2, 0), ("e1", "prefill", 2, 0)]  # fmt: skip
    live.on_event(DecodeStarted(request_id="r9", instance_id="d0"), 2.0)
    live.on_heartbeat(instance("d0", "decode", 1), 3.0)  # num_running 0, but the band is new
    assert live.snapshot(3.0).spans[-1].batch == 1
    live.on_heartbeat(instance("d0", "decode", 1), 4.5)
    assert [s.end for s in live.snapshot(5.0).spans if s.instance == "d0" and s.kind == "decode"] == [4.5]


def test_memory_stays_bounded() -> None:
    live = LiveTimeline(max_spans=500, max_samples=50, max_decisions=100, max_instances=8, max_requests=64)
    for i in range(20_000):
        rid, t = f"r{i}", float(i)
        live.on_decision(plan(rid), t)
        live.on_event(progress(rid, f"prefill-{i % 20}", 4096), t)
        live.on_event(DecodeStarted(request_id=rid, instance_id=f"decode-{i % 20}"), t)
        live.on_heartbeat(instance(f"prefill-{i % 20}", "prefill", 1, used=i % 100), t)
    b = live.builder
    assert len(b.spans) <= 500 and len(b.decisions) <= 100 and len(b.instances) <= 8
    assert len(live._plans) <= 64 and len(live._ends) <= 64 and len(live._decoding) <= 8
    assert all(len(q) <= 50 for q in b._kv.values()) and len(b._kv) <= 8


def _get(url: str, **params: Any) -> httpx.Response:
    return httpx.get(url, params=params, timeout=10)


def test_the_gateway_follows_the_cluster_and_chromium_draws_it(
    harness: Any, gateway_url: str, peer: ScriptedPeer, tmp_path: Path
) -> None:
    async def publish() -> None:
        kv = await registry_bucket(peer.bus)
        for info in (instance("prefill-0", "prefill", 1, used=20), instance("prefill-1", "prefill", 2),
                     instance("decode-0", "decode", 3, used=40)):  # fmt: skip
            await kv.put(info.instance_id, encode(info))
        await peer.bus.publish(subjects.DECISIONS, plan("cmpl-dash"))
        for iid, done in (("prefill-0", 4096), ("prefill-0", 12000), ("prefill-1", 12000)):
            await peer.bus.publish(subjects.EVENTS, progress("cmpl-dash", iid, done))
        await peer.bus.publish(subjects.EVENTS, DecodeStarted(request_id="cmpl-dash", instance_id="decode-0"))
        await peer.bus.nc.flush()

    harness.call(publish())
    url = gateway_url + "/v1/spindle/timeline"

    def heard() -> bool:
        t = decode_json(_get(url).content)
        return {"prefill", "decode"} <= {s.kind for s in t.spans} and len(t.instances) >= 3

    assert wait_until(heard, timeout=10)
    t = decode_json(_get(url, since=time.time() - 30).content)
    assert {"prefill-0", "prefill-1", "decode-0"} <= {i.id for i in t.instances}
    assert any(s.group == ["prefill-0", "prefill-1"] for s in t.spans) and t.decisions[-1].request_id == "cmpl-dash"
    assert_error(_get(url, since="nan"), 400)
    assert_error(_get(url, since="yesterday"), 400)

    page = _get(gateway_url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-live="/v1/spindle/timeline"' in page.text and embedded_timeline(page.text).spans
    png = tmp_path / "dashboard.png"
    marks = drawn(run_chromium(gateway_url + "/dashboard", screenshot=png, budget_ms=2500))
    assert {"prefill-0", "prefill-1", "decode-0"} <= set(marks["instances"].split())
    assert int(marks["prefill-spans"]) >= 3 and int(marks["decode-spans"]) >= 1
    assert int(marks.get("updates", 0)) >= 1  # it polled /v1/spindle/timeline and redrew
    width, height, colours = png_facts(png)
    assert (width, height) == (1400, 900) and colours > 20

    async def leave() -> None:
        kv = await registry_bucket(peer.bus)
        for iid in ("prefill-0", "prefill-1", "decode-0"):
            await kv.delete(iid)

    harness.call(leave())


def test_the_dashboard_can_be_turned_off(harness: Any, peer: ScriptedPeer) -> None:
    if not hasattr(harness, "no_dashboard"):
        harness.no_dashboard = harness.start_gateway(dashboard=False)
    url = harness.no_dashboard.url
    assert harness.no_dashboard.state.dashboard is None
    for path in ("/dashboard", "/v1/spindle/timeline"):
        assert_error(_get(url + path), 404)
    assert "/dashboard" not in httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
