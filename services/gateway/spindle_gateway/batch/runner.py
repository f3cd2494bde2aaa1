"""Runs batches: each batch's pending lines through the gateway's own request path (as throughput-class requests,
`service_class="batch"`, so strategies can defer them to interactive traffic), at most `concurrency` lines of all
batches at once, each line's result stored as it ends. When no line is pending the batch is finalized: its output
file (the lines that got a 2xx) and error file (the others) are written and it is `completed` — or `cancelled`,
or `expired` when its completion window ran out first (the lines not run then fail with `batch_expired`).

A gateway that stops leaves its batches as they are in the store; the next one resumes them (`resume`), running
only the lines without a result. A line cut off by the stop runs again, so a line can run twice across a restart
(never stored twice)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .store import ACTIVE, BatchStore, Line

log = logging.getLogger("spindle.gateway.batch")

# (kind "chat" | "completion", request body) -> (HTTP status, response JSON)
RunLine = Callable[[str, bytes], Awaitable[tuple[int, dict[str, Any]]]]
KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
RETRIED = (429, 503)  # the cluster is full or has no capacity now: a batch line waits and tries again
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0


def result_line(line: Line, status: int, body: dict[str, Any]) -> dict[str, Any]:
    request_id = body.get("id", "") if status < 400 else ""
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(line: Line, code: str, message: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


async def _cancel_until_done(tasks: set[asyncio.Task], every_s: float = 0.05) -> None:
    """Cancel `tasks` until none is left: a cancellation that lands as an awaited reply arrives can be swallowed
    (`asyncio.wait_for` in Python 3.11, used by the NATS request of admission), so once is not enough."""
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.sleep(every_s)


class BatchRunner:
    def __init__(self, store: BatchStore, run_line: RunLine, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be positive, got {concurrency}")
        self.store = store
        self._run_line = run_line
        self._slots = asyncio.Semaphore(concurrency)
        self._runs: dict[str, asyncio.Task] = {}  # batch id -> its runner task
        self._lines: dict[str, set[asyncio.Task]] = {}  # batch id -> its lines in flight
        self._stopping = False

    def view(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The Batch object with live request counts."""
        total, completed, failed = self.store.counts(batch["id"])
        return batch | {"request_counts": {"total": total, "completed": completed, "failed": failed}}

    def resume(self) -> int:
        """Start a runner for every batch a previous gateway left active; returns how many."""
        active = [b["id"] for b in self.store.batches() if b["status"] in ACTIVE]
        for batch_id in active:
            self.start(batch_id)
        if active:
            log.info("resumed %d batch(es): %s", len(active), ", ".join(active))
        return len(active)

    def start(self, batch_id: str) -> None:
        if batch_id not in self._runs:
            task = asyncio.get_running_loop().create_task(self._run(batch_id), name=f"batch {batch_id}")
            self._runs[batch_id] = task
            task.add_done_callback(lambda t: self._runs.pop(batch_id, None))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Stop launching the batch's lines and end those in flight (aborted everywhere); the runner finalizes it
        as `cancelled` with what had ended."""
        batch = self.store.batch(batch_id)
        assert batch is not None
        if batch["status"] in ("validating", "in_progress", "finalizing"):
            batch |= {"status": "cancelling", "cancelling_at": int(time.time())}
            self.store.save_batch(batch)
            if lines := self._lines.get(batch_id):
                asyncio.get_running_loop().create_task(_cancel_until_done(set(lines)))
            self.start(batch_id)  # finalizes it if nothing runs it now
        return self.view(batch)

    async def stop(self) -> None:
        """Gateway shutdown: stop every runner and line, leaving the batches active in the store for the next
        gateway (a line cut off here stores nothing)."""
        self._stopping = True
        await _cancel_until_done(set().union(*self._lines.values()))
        tasks = list(self._runs.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- one batch ----

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        assert batch is not None
        if batch["status"] == "validating":
            batch |= {"status": "in_progress", "in_progress_at": int(time.time())}
            self.store.save_batch(batch)
        kind = KINDS[batch["endpoint"]]
        expired = False
        if batch["status"] == "in_progress":
            pending = self.store.pending_lines(batch_id)
            lines = self._lines.setdefault(batch_id, set())
            try:
                for line in pending:
                    await self._slots.acquire()
                    batch = self.store.batch(batch_id)  # cancelled or expired meanwhile?
                    assert batch is not None
                    expired = time.time() >= batch["expires_at"]
                    if expired or batch["status"] != "in_progress" or self._stopping:
                        self._slots.release()
                        break
                    task = asyncio.get_running_loop().create_task(self._one(batch_id, kind, line, batch["expires_at"]))
                    lines.add(task)
                    task.add_done_callback(lines.discard)
                    task.add_done_callback(lambda _: self._slots.release())  # also when cancelled before it ran
                while lines:
                    await asyncio.wait(set(lines))
            finally:
                for task in set(lines):
                    task.cancel()
                self._lines.pop(batch_id, None)
        if not self._stopping:  # else the next gateway goes on with it
            self._finalize(batch_id, expired)

    async def _one(self, batch_id: str, kind: str, line: Line, expires_at: float) -> None:
        """One line (holding one of the runner's slots). Overload (429) and no capacity (503) are retried with
        back-off until the window ends: throughput work waits rather than fails. Cancelled, or cut off by the
        gateway stopping, it stores nothing (a resumed batch runs it again)."""
        body = json.dumps(line.request["body"]).encode()
        delay = RETRY_FIRST_S
        while True:
            try:
                status, response = await self._run_line(kind, body)
            except Exception as e:  # a bug, not the client's: the line fails, the batch goes on
                log.exception("batch %s line %d failed", batch_id, line.line)
                status, response = 500, {"error": {"message": f"internal error: {type(e).__name__}",
                                                   "type": "internal_error", "param": None, "code": None}}  # fmt: skip
            if self._stopping:
                return
            if status not in RETRIED or time.time() + delay >= expires_at:
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
        self.store.finish_line(batch_id, line.line, result_line(line, status, response), ok=status < 400)

    def _finalize(self, batch_id: str, expired: bool) -> None:
        batch = self.store.batch(batch_id)
        assert batch is not None
        now = int(time.time())
        if expired and batch["status"] == "in_progress":
            for line in self.store.pending_lines(batch_id):
                self.store.finish_line(batch_id, line.line, error_line(line, "batch_expired", "This request could "
                                       "not be executed before the completion window expired."), ok=False)  # fmt: skip
        batch |= {"finalizing_at": now}
        for ok, key in ((True, "output_file_id"), (False, "error_file_id")):
            content = self.store.results(batch_id, ok)
            if content:
                name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                batch[key] = self.store.add_file(content, name, "batch_output")["id"]
        if batch["status"] == "cancelling":
            batch |= {"status": "cancelled", "cancelled_at": now}
        elif expired:
            batch |= {"status": "expired", "expired_at": now}
        else:
            batch |= {"status": "completed", "completed_at": now}
        batch |= self.view(batch)
        self.store.save_batch(batch)
        counts = batch["request_counts"]
        log.info("batch %s %s: %d of %d lines completed, %d failed", batch_id, batch["status"], counts["completed"],
                 counts["total"], counts["failed"])  # fmt: skip
