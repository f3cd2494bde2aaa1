"""`spindle sim --timeline out.html`: the run's timeline as the dashboard's page, for a disaggregated SP strategy, a
colocated one and a per-iteration (elastic) one; recording changes nothing in the run's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle_policy.actions import KVShard, PrefillChunk, RunPrefill
from spindle_policy.decisions import compact_ids, decision, plan_text
from spindle_protocol.messages import Prompt, RequestSpec, Sampling
from spindle_sim.commands import main
from spindle_telemetry.timeline import embedded_timeline

RUN = ["--workload", "tetris-short", "--rate", "2", "--instances", "4", "--decode-instances", "2", "--seed", "3"]
N = 30


def _run(tmp_path: Path, strategy: str, timeline: bool) -> tuple[dict, Path]:
    tag = strategy.replace(":", "_").replace("=", "_") + ("-recorded" if timeline else "")
    out, page = tmp_path / f"{tag}.json", tmp_path / f"{tag}.html"
    argv = [*RUN, "--strategy", strategy, "--num-requests", str(N), "--json", str(out)]
    assert main(argv + (["--timeline", str(page)] if timeline else [])) == 0
    summary = json.loads(out.read_text())
    summary.pop("plan_us")  # wall times
    return summary, page


@pytest.mark.parametrize(
    ("strategy", "roles"),
    [("request-sp:grow=1024", {"prefill", "decode"}), ("chunked", {"elastic"}), ("loongserve", {"elastic"})],
)
def test_the_timeline_page_has_every_instance_and_request(
    tmp_path: Path, strategy: str, roles: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    plain, _ = _run(tmp_path, strategy, timeline=False)
    recorded, page = _run(tmp_path, strategy, timeline=True)
    assert recorded == plain and plain["completed"] == N  # the same run, recorded or not
    assert f"timeline: {page}" in capsys.readouterr().out
    html = page.read_text()
    t = embedded_timeline(html)
    ids = {i.id for i in t.instances}
    assert {i.role for i in t.instances} == roles | {"kvstore"} and all(i in html for i in ids)
    prefilled = {r for s in t.spans if s.kind == "prefill" for r in s.requests}
    decoded = {r for s in t.spans if s.kind == "decode" for r in s.requests}
    assert prefilled == {f"req-{i}" for i in range(N)} and decoded and decoded <= prefilled
    assert {s.instance for s in t.spans} <= ids and all(s.start <= s.end for s in t.spans)
    assert len({d.request_id for d in t.decisions}) == N and t.strategy.startswith(strategy.split(":")[0])
    assert t.kv and t.queues and 0 <= t.start < t.end
    if strategy.startswith("request-sp"):  # SP chunks name their group; each member has a span
        sp = [s for s in t.spans if s.sp > 1]
        assert sp and all(len(s.group) == s.sp and s.instance in s.group for s in sp)
        assert {s.kind for s in t.spans} >= {"prefill", "decode", "transfer"}
    spans_per_request = len([s for s in t.spans if s.kind in ("prefill", "decode")]) / N
    assert spans_per_request < 40, "decode steps and a request's back-to-back chunks are merged"


def test_decision_texts() -> None:
    assert compact_ids(["prefill-0", "prefill-1", "prefill-2", "prefill-3"]) == "prefill-0..3"
    assert compact_ids(["prefill-0", "prefill-2", "prefill-3"]) == "prefill-0,prefill-2,prefill-3"
    spec = RequestSpec(request_id="r", prompt=Prompt(num_tokens=20000), sampling=Sampling(max_tokens=4),
                       arrival_time=0.0, deadline=9.0)  # fmt: skip
    group = tuple(f"prefill-{i}" for i in range(4))
    plan = RunPrefill(spec, (PrefillChunk(0, 8192, group[:1]), PrefillChunk(8192, 20000, group)), "decode-1",
                      decode_shards=(KVShard("decode-1", 0, 9000), KVShard("decode-2", 9000, 20000)))  # fmt: skip
    text = "SP 4 on prefill-0..3, chunks 0-8192@1, 8192-20000@4, decode decode-1 (KV over decode-1,decode-2)"
    assert plan_text(plan) == text
    d = decision(plan, "tetris", 5.0)
    assert d is not None and d.listed and d.text == text and d.chunks[1].members == list(group)
    colocated = RunPrefill(spec, (PrefillChunk(0, 512, ("elastic-0",)), PrefillChunk(512, 20000, ("elastic-0",))),
                           "elastic-0")  # fmt: skip
    assert plan_text(colocated) == "colocated on elastic-0: 20000 prompt tokens in 2 chunks of <= 19488 tokens"


def test_compare_writes_a_page_per_strategy(tmp_path: Path) -> None:
    page = tmp_path / "cmp.html"
    argv = ["compare", "--strategies", "tetris", "loongserve", *RUN, "--num-requests", "10", "--timeline", str(page)]
    assert main(argv) == 0
    for spec in ("tetris", "loongserve"):
        t = embedded_timeline((tmp_path / f"cmp.{spec}.html").read_text())
        prefilled = {r for s in t.spans if s.kind == "prefill" for r in s.requests}
        assert t.strategy.startswith(spec) and len(prefilled) == 10
