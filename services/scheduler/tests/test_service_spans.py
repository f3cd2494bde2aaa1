"""The scheduler service alone: a real nats-server, `python -m spindle_scheduler`, and scripted peers (the test
beats the registry for a prefill and a decode instance and listens where the prefill instance would), with the
spans the service writes checked for names, parent links, kind, attributes and error status."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from spindle_policy.testing import instance_info, request_spec
from spindle_protocol import Bus, decode, subjects
from spindle_protocol.codec import encode
from spindle_protocol.messages import (
    Abort,
    AdmitReply,
    AdmitRequest,
    ClusterStatus,
    Prompt,
    RunPrefill,
    StatusQuery,
)
from spindle_protocol.nats_server import start_nats_server
from spindle_protocol.registry import registry_bucket

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
MAX_MODEL_LEN = 1600


class Scheduler:
    def __init__(self, nats_url: str, trace_file: Path) -> None:
        self.nats_url = nats_url
        self.trace_file = trace_file

    def spans(self, request_id: str, names: set[str], timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """The spans of `request_id`'s trace by name, once every one of `names` is written."""
        deadline = time.monotonic() + timeout
        found: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            if self.trace_file.exists():
                records = [json.loads(line) for line in self.trace_file.read_text().splitlines() if line]
                # the admission span names the request; its children have it as their parent
                ids = {r["span_id"] for r in records if r["attributes"].get("spindle.request_id") == request_id}
                found = {r["name"]: r for r in records if r["span_id"] in ids or r["parent_id"] in ids}
                if names <= set(found):
                    return found
            time.sleep(0.1)
        raise AssertionError(f"spans {sorted(names - set(found))} of {request_id} not written in {timeout} s")


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    trace_file = tmp_path_factory.mktemp("scheduler") / "spans.jsonl"
    log_path = trace_file.with_name("scheduler.log")
    nats = start_nats_server()
    env = {**os.environ, "SPINDLE_TRACE_FILE": str(trace_file)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    cmd = [sys.executable, "-m", "spindle_scheduler", "--strategy", "single", "--nats-url", nats.url]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_wait_ready(nats.url, proc))
        yield Scheduler(nats.url, trace_file)
        assert proc.poll() is None, "the scheduler died during the tests"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        nats.stop()
    assert proc.returncode == 0, f"the scheduler exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"


async def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    bus = await Bus.connect(url, "scheduler-test-ready")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the scheduler exited during start-up"
            try:
                await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus, timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.1)
        raise TimeoutError("the scheduler did not answer its status")
    finally:
        await bus.close()


async def _beat(bus: Bus) -> None:
    """The scripted instances' heartbeats (a prefill and a decode instance) until cancelled."""
    kv = await registry_bucket(bus)
    while True:
        now = time.time()
        for info in (
            instance_info("prefill-0", "prefill", 1, at=now, max_model_len=MAX_MODEL_LEN),
            instance_info("decode-0", "decode", 2, at=now, max_model_len=MAX_MODEL_LEN),
        ):
            await kv.put(info.instance_id, encode(info))
        await asyncio.sleep(0.3)


def _run(scheduler: Scheduler, scenario: Any) -> Any:
    async def main() -> Any:
        bus = await Bus.connect(scheduler.nats_url, "scheduler-test")
        beating = asyncio.create_task(_beat(bus))
        try:
            for _ in range(100):  # until the scheduler plans with both instances
                status = await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus)
                if {i.instance_id for i in status.instances} >= {"prefill-0", "decode-0"}:
                    break
                await asyncio.sleep(0.1)
            return await scenario(bus)
        finally:
            beating.cancel()
            await bus.close()

    return asyncio.run(main())


def test_an_admission_is_a_server_span_in_the_callers_trace_and_its_command_carries_it(scheduler: Scheduler) -> None:
    async def scenario(bus: Bus) -> tuple[AdmitReply, RunPrefill, dict[str, str]]:
        commands: asyncio.Queue[Any] = asyncio.Queue()
        sub = await bus.nc.subscribe(subjects.prefill_run("prefill-0"), cb=commands.put)
        try:
            spec = request_spec("traced-1")
            reply = await bus.request(subjects.ADMIT, AdmitRequest(request=spec), AdmitReply, headers=TRACEPARENT)
            raw = await asyncio.wait_for(commands.get(), 10)
            await bus.publish(subjects.ABORT, Abort(request_id="traced-1"))
            return reply, decode(raw.data, RunPrefill), dict(raw.headers or {})
        finally:
            await sub.unsubscribe()

    reply, command, headers = _run(scheduler, scenario)
    assert reply.accepted and (reply.prefill_instance, reply.decode_instance) == ("prefill-0", "decode-0")
    assert command.request.request_id == "traced-1" and command.decode_instance == "decode-0"

    spans = scheduler.spans("traced-1", {"scheduler.admit", "scheduler.plan"})
    admit, plan = spans["scheduler.admit"], spans["scheduler.plan"]
    assert (admit["trace_id"], admit["parent_id"]) == (TRACE_ID, PARENT_ID)  # continues the gateway's trace
    assert admit["kind"] == "SERVER" and admit["status"] == "UNSET" and admit["service"] == "spindle-scheduler"
    attrs = admit["attributes"]
    assert attrs["spindle.request_id"] == "traced-1" and attrs["spindle.prompt_tokens"] == 300
    assert attrs["spindle.strategy"] == "single" and attrs["spindle.accepted"] is True
    assert (plan["trace_id"], plan["parent_id"], plan["kind"]) == (TRACE_ID, admit["span_id"], "INTERNAL")
    assert plan["attributes"]["spindle.actions"] == ["Admit", "RunPrefill"]
    # the command to the prefill instance carries the admission's context: its spans join the same trace
    assert headers["traceparent"].split("-")[1:3] == [TRACE_ID, admit["span_id"]]


def test_a_rejected_admission_is_an_error_span_that_says_why(scheduler: Scheduler) -> None:
    too_long = Prompt(num_tokens=MAX_MODEL_LEN + 1)
    spec = msgspec.structs.replace(request_spec("traced-2"), prompt=too_long)

    async def scenario(bus: Bus) -> AdmitReply:
        return await bus.request(subjects.ADMIT, AdmitRequest(request=spec), AdmitReply, headers=TRACEPARENT)

    reply = _run(scheduler, scenario)
    assert not reply.accepted and reply.status == 400 and reply.reason
    admit = scheduler.spans("traced-2", {"scheduler.admit"})["scheduler.admit"]
    assert (admit["kind"], admit["status"], admit["status_description"]) == ("SERVER", "ERROR", reply.reason)
    assert admit["attributes"]["spindle.accepted"] is False
    assert admit["attributes"]["spindle.rejected"] == reply.reason


@pytest.mark.parametrize(
    ("strategy", "latency"), [("chunked", False), ("fixed-sp:sp=2", True), ("request-sp", True), ("single", False)]
)
def test_the_service_plans_with_the_strategy_it_is_given(strategy: str, latency: bool) -> None:
    from spindle_policy.calibration import load_paper_calibration
    from spindle_scheduler.service import SchedulerService, SchedulerServiceConfig

    model = load_paper_calibration() if latency else None
    service = SchedulerService(SchedulerServiceConfig(nats_url="nats://127.0.0.1:1", strategy=strategy, latency=model))
    assert (
        service.core.strategy.describe().startswith(strategy) and service.core.strategy.name == strategy.split(":")[0]
    )
