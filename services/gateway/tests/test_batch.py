"""The Batch API (/v1/files, /v1/batches) through the official `openai` client, unchanged, against the gateway on a
real port with its SQLite store in a temporary directory (SCRIPTED NATS PEER behind it)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from spindle_gateway.batch.lines import parse_input
from spindle_protocol.messages import AdmitReply

from .conftest import Harness, RunningGateway
from .fuzz import fuzz
from .scripted_peer import ANSWER, MODEL, ScriptedPeer, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": QUESTION, "max_tokens": 16} | body}  # fmt: skip


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)


class Gateways:
    """Gateways on one batch store, started and stopped by the test (a restart is a new gateway on the file)."""

    def __init__(self, harness: Harness, db: Path) -> None:
        self.harness, self.db = harness, db
        self.running: list[RunningGateway] = []

    def start(self, **overrides: Any) -> openai.OpenAI:
        gw = self.harness.start_gateway(batch_db=str(self.db), **overrides)
        self.harness.gateways.remove(gw)  # stopped here, not by the harness
        self.running.append(gw)
        return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=10)

    def stop(self, gw: RunningGateway) -> None:
        self.running.remove(gw)
        self.harness.call(gw.stop())


@pytest.fixture
def gateways(harness: Harness, peer: ScriptedPeer, tmp_path: Path) -> Iterator[Gateways]:
    g = Gateways(harness, tmp_path / "batches.sqlite")
    try:
        yield g
    finally:
        for gw in list(g.running):
            g.stop(gw)


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is {batch.status}, not {statuses}")


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    return {r["custom_id"]: r for r in map(json.loads, client.files.content(file_id).text.splitlines())}


def test_a_batch_runs_every_line_as_batch_class_and_reports_each_result(gateways: Gateways, peer: ScriptedPeer) -> None:
    client = gateways.start()
    rows = [
        line("ok-chat"),
        line("ok-completion", url="/v1/completions", prompt="The capital of France is", messages=None),
        line("bad-temperature", temperature=-1),
        line("streaming", stream=True),
        line("wrong-model", model="nope"),
    ]
    rows[1]["body"].pop("messages")
    batch_file = jsonl([rows[0], rows[2], rows[3], rows[4]])
    f = client.files.create(file=("in.jsonl", io.BytesIO(batch_file)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(batch_file) and f.filename == "in.jsonl"
    assert client.files.retrieve(f.id).id == f.id and client.files.content(f.id).content == batch_file

    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})  # fmt: skip
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 4
    done = wait_for(client, batch.id, ("completed",))
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 1, 3)
    assert done.metadata == {"job": "nightly"} and done.completed_at and done.in_progress_at
    out, err = results(client, done.output_file_id), results(client, done.error_file_id)
    assert list(out) == ["ok-chat"] and set(err) == {"bad-temperature", "streaming", "wrong-model"}
    ok = out["ok-chat"]["response"]
    assert ok["status_code"] == 200 and ok["body"]["choices"][0]["message"]["content"] == ANSWER
    assert ok["request_id"] == ok["body"]["id"]
    assert {k: v["response"]["status_code"] for k, v in err.items()} == {
        "bad-temperature": 400, "streaming": 400, "wrong-model": 404}  # fmt: skip
    assert "stream" in err["streaming"]["response"]["body"]["error"]["message"]
    assert [s.service_class for s in peer.admits] == ["batch"]  # only the valid line reached the scheduler

    completion = client.files.create(file=("c.jsonl", io.BytesIO(jsonl([rows[1]]))), purpose="batch")
    batch2 = client.batches.create(input_file_id=completion.id, endpoint="/v1/completions", completion_window="24h")
    done2 = wait_for(client, batch2.id, ("completed",))
    assert results(client, done2.output_file_id)["ok-completion"]["response"]["body"]["choices"][0]["text"] == ANSWER
    assert done2.error_file_id is None
    assert [b.id for b in client.batches.list()] == [batch2.id, batch.id]
    assert {x.id for x in client.files.list()} >= {f.id, completion.id, done.output_file_id, done.error_file_id}
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_a_malformed_input_file_fails_the_batch_naming_each_bad_line(gateways: Gateways) -> None:
    client = gateways.start()
    rows = [line("a"), "{not json", line("a"), line("b", url="/v1/embeddings"), {"custom_id": "c", "method": "GET",
            "url": "/v1/chat/completions", "body": {}}, "[1, 2]"]  # fmt: skip
    f = client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at and batch.request_counts.total == 0
    problems = [(e.line, e.code) for e in batch.errors.data]
    assert problems == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url"),
                        (5, "invalid_method"), (6, "invalid_json_line")]  # fmt: skip


def test_bad_requests_are_4xx_and_quotas_hold(gateways: Gateways, peer: ScriptedPeer) -> None:
    client = gateways.start(batch_max_file_bytes=2000, batch_max_lines=2)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("a")]))), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 2001)), purpose="batch")
    assert e.value.status_code == 413
    f = client.files.create(file=("three.jsonl", io.BytesIO(jsonl([line("a"), line("b"), line("c")]))),
                            purpose="batch")  # fmt: skip
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors.data[0].code == "too_many_lines"
    for kwargs, param in [
        ({"input_file_id": f.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}, "input_file_id"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(**kwargs)
        assert bad.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    url = str(client.base_url).rstrip("/")
    assert httpx.post(url + "/files", content=b"{}", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url + "/batches", content=b"{nope").status_code == 400
    assert peer.admits == []


def test_cancel_ends_the_running_line_everywhere_and_keeps_what_finished(
    gateways: Gateways, harness: Harness, peer: ScriptedPeer
) -> None:
    client = gateways.start(batch_concurrency=1)
    peer.script = lambda spec: (peer.answer_script if len(peer.admits) == 1 else peer.endless_script())(spec)
    peer.interval = 0.01
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a"), line("b"), line("c")]))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: len(peer.admits) == 2, timeout=10)  # "a" finished, "b" runs forever
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, ("cancelled",))
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 0) and done.cancelled_at
    assert list(results(client, done.output_file_id)) == ["a"] and done.error_file_id is None
    assert wait_until(lambda: peer.aborted(peer.admits[1].request_id), timeout=5)
    assert len(peer.admits) == 2  # "c" never started
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.cancel(batch.id)
    assert e.value.status_code == 409


def test_a_restarted_gateway_resumes_its_batches_from_the_store(
    gateways: Gateways, harness: Harness, peer: ScriptedPeer
) -> None:
    client = gateways.start(batch_concurrency=1)
    peer.script, peer.interval = peer.endless_script(), 0.01
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a"), line("b")]))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: len(peer.admits) == 1, timeout=10)
    gateways.stop(gateways.running[0])  # mid-line: the line is aborted, the batch stays in progress in the store
    assert wait_until(lambda: peer.aborted(peer.admits[0].request_id), timeout=5)
    peer.script = peer.answer_script

    client = gateways.start(batch_concurrency=1)
    done = wait_for(client, batch.id, ("completed",))
    assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
    assert set(results(client, done.output_file_id)) == {"a", "b"} and len(peer.admits) == 3  # "a" ran again
    assert client.files.retrieve(f.id).bytes > 0


def test_a_batch_past_its_window_expires_its_unstarted_lines(
    gateways: Gateways, harness: Harness, peer: ScriptedPeer
) -> None:
    client = gateways.start(batch_concurrency=1)
    store = gateways.running[0].state.batches

    async def expire(batch_id: str) -> None:  # as if 24 hours had passed (on the gateway's loop: its connection)
        store.save_batch(store.batch(batch_id) | {"expires_at": int(time.time()) - 1})

    peer.interval = 0.05  # each line takes a while
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a"), line("b"), line("c")]))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: len(peer.admits) == 1, timeout=10)
    harness.call(expire(batch.id))
    done = wait_for(client, batch.id, ("expired",))
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2) and done.expired_at
    err = results(client, done.error_file_id)
    assert set(err) == {"b", "c"} and {e["error"]["code"] for e in err.values()} == {"batch_expired"}


def test_an_overloaded_cluster_delays_a_line_instead_of_failing_it(gateways: Gateways, peer: ScriptedPeer) -> None:
    client = gateways.start()
    peer.admit_reply = AdmitReply(accepted=False, status=429, reason="busy", retry_after_s=1)
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a")]))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: len(peer.admits) >= 2, timeout=10)  # refused, tried again
    peer.admit_reply = AdmitReply(accepted=True, prefill_instance="prefill-0", decode_instance="decode-0")
    done = wait_for(client, batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 0)


@pytest.mark.parametrize(
    ("content", "code"),
    [(b"\xff\xfe", "invalid_file"), (b"\n  \n", "empty_file"), (b'{"custom_id": "a"}\n', "invalid_method")],
)
def test_input_files_that_are_not_requests_are_refused_with_a_reason(content: bytes, code: str) -> None:
    lines, problems = parse_input(content, "/v1/chat/completions", max_lines=10)
    assert lines == [] and problems[0]["code"] == code


def test_fuzzed_batch_requests_get_no_5xx_and_error_json(gateways: Gateways) -> None:
    """schemathesis' cases (valid and invalid) for every Files / Batches operation /openapi.json documents, with a
    real file and batch in the store so that valid ids exist too."""
    import schemathesis

    client = gateways.start()
    url = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a")]))), purpose="batch")
    client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith(("/v1/files", "/v1/batches"))]
    assert {op.path for op in operations} >= {"/v1/batches", "/v1/batches/{batch_id}/cancel", "/v1/files/{file_id}"}
    calls = fuzz(url, operations, examples=15)
    print(f"\nschemathesis: {sum(calls.values())} calls over {len(operations)} batch operations, by status {calls}")
    assert calls.get(400, 0) > 0 and sum(v for k, v in calls.items() if k < 300) > 0
