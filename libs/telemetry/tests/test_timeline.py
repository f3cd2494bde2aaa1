"""The timeline model, its builder (merging, bounded buffers, windows) and its page: rendered from a small handmade
timeline and drawn by headless Chromium from a file:// URL (a screenshot checked, and the DOM the script drew)."""

from __future__ import annotations

import re
from pathlib import Path

from spindle_telemetry.timeline import (
    DecisionRow,
    InstanceRow,
    Span,
    TimelineBuilder,
    decode_json,
    embedded_timeline,
    encode_json,
    render_html,
)
from spindle_telemetry.timeline.browser import drawn, png_facts, run_chromium

INSTANCES = ("prefill-0", "prefill-1", "decode-0")
SVG_NS = "http://www.w3.org/2000/svg"


def handmade() -> TimelineBuilder:
    b = TimelineBuilder()
    for rank, iid in enumerate(INSTANCES):
        b.instance(InstanceRow(id=iid, role=iid.split("-")[0], rank=rank, node="node-0", kv_blocks_total=100))
    b.chunk(Span(instance="prefill-0", start=0.0, end=0.4, kind="prefill", requests=["req-0"], token_end=4096))
    group = ["prefill-0", "prefill-1"]
    for m in group:  # the next chunk grows the group to SP 2
        b.chunk(Span(instance=m, start=0.4, end=0.9, kind="prefill", requests=["req-0"], group=group, sp=2,
                     token_start=4096, token_end=12000))  # fmt: skip
    b.chunk(Span(instance="prefill-1", start=0.0, end=0.3, kind="prefill", requests=["req-1</script>"], token_end=900))
    b.span(Span(instance="decode-0", start=0.9, end=0.95, kind="transfer", requests=["req-0"]))
    t = 0.3
    for step in range(30):
        b.decode_step("decode-0", t, t + 0.03, ["req-1"] if step < 20 else ["req-1", "req-0"])
        t += 0.03
    for t, used in ((0.0, 0), (0.4, 30), (1.0, 70)):
        b.kv("decode-0", t, used, 100)
        b.kv("decode-0", t + 0.1, used, 100)  # unchanged: not kept
        b.queue("prefill-0", t, used // 10, used * 100)
    b.decision(DecisionRow(t=0.0, request_id="req-0", strategy="tetris", text="SP 2 on prefill-0..1, chunks 0-4096@1"))
    return b


def test_steps_and_chunks_merge_and_windows_cut() -> None:
    b = handmade()
    decode = [s for s in b.spans if s.kind == "decode"]
    assert [(s.batch, s.start, s.end) for s in decode] == [(1, 0.3, 0.9), (2, 0.9, 1.2)]  # 30 steps, 2 spans
    p0 = [s for s in b.spans if s.instance == "prefill-0"]
    assert [(s.token_start, s.token_end, s.sp) for s in p0] == [(0, 4096, 1), (4096, 12000, 2)]  # new group: no merge
    b.chunk(Span(instance="prefill-0", start=0.9, end=1.0, kind="prefill", requests=["req-0"],
                 group=["prefill-0", "prefill-1"], sp=2, token_start=12000, token_end=13000))  # fmt: skip
    merged = [s for s in b.spans if s.instance == "prefill-0" and s.token_end == 13000]
    assert len(merged) == 1 and (merged[0].token_start, merged[0].chunks, merged[0].end) == (4096, 2, 1.0)

    w = b.snapshot(0.5, 1.05)
    assert {s.kind for s in w.spans} == {"prefill", "decode", "transfer"}
    assert [(k.t, k.used) for k in w.kv] == [(0.5, 30), (1.0, 70)]  # led by the sample in force at the start
    assert w.decisions == [] and len(b.snapshot(0.0, 1.0).decisions) == 1
    assert decode_json(encode_json(w)) == w


def test_decode_levels_and_bounded_buffers() -> None:
    b = TimelineBuilder(max_spans=50, max_samples=10, max_decisions=5, max_instances=3)
    for i in range(1000):
        b.decode_level("decode-0", float(i), [f"r{k}" for k in range(i % 4)])
        b.kv("decode-0", float(i), i, 1000)
        b.decision(DecisionRow(t=float(i), text=str(i)))
        b.instance(InstanceRow(id=f"i{i % 7}", role="decode"))
    assert len(b.spans) == 50 and len(b.decisions) == 5 and len(b.instances) == 3 and len(b._kv["decode-0"]) == 10
    w = b.snapshot(990.0, 999.5)
    assert w.spans[-1].end == 999.5 and w.spans[-1].batch == 3  # the batch running now ends at the window's end
    assert b.snapshot(0.0, 10.0).spans == []  # gone from the ring


def test_the_page_is_self_contained_and_carries_the_timeline() -> None:
    timeline = handmade().snapshot(0.0, 1.3, title="handmade <run>")
    page = render_html(timeline)
    assert "req-1</script>" not in page and "<title>handmade &lt;run&gt;</title>" in page
    assert set(re.findall(r"https?://[^\"'\s)]+", page)) == {SVG_NS}  # nothing to fetch: no URL but SVG's namespace
    assert not re.search(r"src=|href=|@import|url\(", page)
    assert embedded_timeline(page) == timeline
    assert 'data-live="/v1/spindle/timeline"' in render_html(timeline, live_url="/v1/spindle/timeline")


def test_chromium_draws_the_static_page(tmp_path: Path) -> None:
    page, png = tmp_path / "timeline.html", tmp_path / "timeline.png"
    page.write_text(render_html(handmade().snapshot(0.0, 1.3, title="handmade")))
    dom = run_chromium(page.as_uri(), screenshot=png, size=(1400, 900))
    marks = drawn(dom)
    assert marks["drawn"] == "1" and marks["instances"].split() == list(INSTANCES)
    assert int(marks["prefill-spans"]) == 4 and int(marks["decode-spans"]) == 2 and int(marks["requests"]) == 2
    assert dom.count('class="sp-link"') == 1 and "SP 2 on prefill-0..1" in dom
    width, height, colours = png_facts(png)
    assert (width, height) == (1400, 900) and colours > 20
