"""Trace context survives a real NATS hop between two processes; spans reach an OTLP receiver and files."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import spindle_telemetry as telemetry
from spindle_protocol import Bus, InstanceStats, StatsQuery
from spindle_protocol.nats_server import start_nats_server
from spindle_telemetry.testing import OtlpReceiver

WORKER = Path(__file__).with_name("traced_worker.py")


@pytest.fixture
def nats_url():
    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


def test_parent_link_across_processes_over_nats(nats_url: str) -> None:
    subject = "spindle.test.traced"
    with OtlpReceiver() as rx:
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), nats_url, rx.endpoint, subject], stdout=subprocess.PIPE, text=True
        )
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
            telemetry.setup("test-client", rx.endpoint)

            async def call() -> InstanceStats:
                bus = await Bus.connect(nats_url, "test-client", inject=telemetry.inject)
                try:
                    with telemetry.tracer("test").start_as_current_span("client.request"):
                        return await bus.request(subject, StatsQuery(), InstanceStats, timeout=10)
                finally:
                    await bus.close()

            assert asyncio.run(call()).instance_id == "w-0"
            telemetry.shutdown()
            assert worker.wait(20) == 0
            spans = rx.wait_for(lambda s: {x.name for x in s} >= {"client.request", "worker.handle"})
        finally:
            worker.kill()
            worker.wait()
            telemetry.shutdown()
    by_name = {s.name: s for s in spans}
    parent, child = by_name["client.request"], by_name["worker.handle"]
    assert (parent.service, child.service) == ("test-client", "test-worker")
    assert parent.parent_id is None
    assert child.trace_id == parent.trace_id and len(child.trace_id) == 32
    assert child.parent_id == parent.span_id
    assert len(rx.traces()) == 1


def test_trace_file_exporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("SPINDLE_TRACE_FILE", str(path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    telemetry.setup("file-svc")
    try:
        tr = telemetry.tracer("t")
        with tr.start_as_current_span("outer") as outer:
            headers: dict[str, str] = {}
            telemetry.inject(headers)
        with tr.start_as_current_span("inner", context=telemetry.extract(headers), attributes={"n": 3, "k": [1, 2]}):
            pass
    finally:
        telemetry.shutdown()
        telemetry.shutdown()  # idempotent
    records = {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(records) == {"outer", "inner"}
    ctx = outer.get_span_context()
    assert records["outer"]["trace_id"] == records["inner"]["trace_id"] == f"{ctx.trace_id:032x}"
    assert records["inner"]["parent_id"] == records["outer"]["span_id"]
    assert records["outer"]["parent_id"] is None
    assert records["inner"]["service"] == "file-svc"
    assert records["inner"]["attributes"] == {"n": 3, "k": [1, 2]}
    assert records["inner"]["start"] <= records["inner"]["end"]


def test_noop_without_exporters_still_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPINDLE_TRACE_FILE", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    telemetry.setup("quiet")
    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with telemetry.tracer("t").start_as_current_span("hop", context=telemetry.extract(incoming)) as span:
        assert not span.is_recording()
        outgoing: dict[str, str] = {}
        telemetry.inject(outgoing)
    assert outgoing["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert telemetry.extract(None) is not None
    empty: dict[str, str] = {}
    telemetry.inject(empty)
    assert empty == {}
    with pytest.raises(ValueError):
        telemetry.setup("")
