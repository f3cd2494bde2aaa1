"""OpenAI's Files and Batch APIs on the gateway: `POST /v1/files` (multipart, purpose `batch`), `GET /v1/files`,
`GET /v1/files/{id}[/content]`, `DELETE /v1/files/{id}`, `POST /v1/batches`, `GET /v1/batches[/{id}]`,
`POST /v1/batches/{id}/cancel`. The official `openai` client's `files.*` and `batches.*` calls work unchanged."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.datastructures import UploadFile

from ..errors import GatewayError
from ..schemas import parse_body
from .lines import ENDPOINTS, parse_input
from .runner import BatchRunner

PATHS = ("/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
         "/v1/batches/{batch_id}/cancel")  # fmt: skip
WINDOWS = ("24h",)
WINDOW_S = {"24h": 24 * 3600}
_encode = msgspec.json.Encoder().encode


def _json(obj: Any) -> Response:
    return Response(_encode(obj), media_type="application/json")


class CreateBatch(BaseModel):
    """The body of `POST /v1/batches` (OpenAI's)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

    @field_validator("input_file_id", "endpoint", "completion_window", mode="before")
    @classmethod
    def _text(cls, v: object) -> object:
        if not isinstance(v, str):  # no coercion from numbers
            raise ValueError("must be a string")
        return v


def install(app: FastAPI, runner: BatchRunner, max_file_bytes: int, max_lines: int) -> None:
    store = runner.store

    def file_or_404(file_id: str) -> dict[str, Any]:
        f = store.file(file_id)
        if f is None:
            raise GatewayError(404, f"No such File object: {file_id}", param="file_id")
        return f

    def batch_or_404(batch_id: str) -> dict[str, Any]:
        b = store.batch(batch_id)
        if b is None:
            raise GatewayError(404, f"No such Batch object: {batch_id}", param="batch_id")
        return b

    @app.post("/v1/files")
    async def create_file(request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise GatewayError(400, "upload the file as multipart/form-data with fields `file` and `purpose`")
        async with request.form(max_files=1, max_fields=4) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise GatewayError(400, f"purpose must be 'batch' (the only purpose served here), got {purpose!r}",
                                   param="purpose")  # fmt: skip
            if not isinstance(upload, UploadFile):
                raise GatewayError(400, "the form has no `file`", param="file")
            content = await upload.read(max_file_bytes + 1)
            if len(content) > max_file_bytes:
                raise GatewayError(413, f"the file is larger than {max_file_bytes} bytes, the most accepted",
                                   param="file")  # fmt: skip
            return _json(store.add_file(content, upload.filename or "upload.jsonl", "batch"))

    @app.api_route("/v1/files", methods=["GET", "HEAD"])
    async def list_files(purpose: str | None = None) -> Response:
        return _json({"object": "list", "data": store.files(purpose), "has_more": False})

    @app.api_route("/v1/files/{file_id}", methods=["GET", "HEAD"])
    async def retrieve_file(file_id: str) -> Response:
        return _json(file_or_404(file_id))

    @app.api_route("/v1/files/{file_id}/content", methods=["GET", "HEAD"])
    async def file_content(file_id: str) -> Response:
        file_or_404(file_id)
        return Response(store.content(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        file_or_404(file_id)
        store.delete_file(file_id)
        return _json({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        req = parse_body(await request.body(), CreateBatch)
        if req.endpoint not in ENDPOINTS:
            raise GatewayError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {req.endpoint!r}",
                               param="endpoint")  # fmt: skip
        if req.completion_window not in WINDOWS:
            raise GatewayError(400, f"completion_window must be one of {WINDOWS}, got {req.completion_window!r}",
                               param="completion_window")  # fmt: skip
        if req.metadata is not None and len(req.metadata) > 16:
            raise GatewayError(400, "metadata takes at most 16 keys", param="metadata")
        f = store.file(req.input_file_id)
        if f is None or f["purpose"] != "batch":
            raise GatewayError(400, f"input_file_id {req.input_file_id!r} is not a file uploaded with purpose "
                               "'batch'", param="input_file_id")  # fmt: skip
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": "batch_" + uuid.uuid4().hex,
            "object": "batch",
            "endpoint": req.endpoint,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_S[req.completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata,
        }
        lines, problems = parse_input(store.content(req.input_file_id) or b"", req.endpoint, max_lines)
        if problems:
            batch |= {"status": "failed", "failed_at": now, "errors": {"object": "list", "data": problems}}
        store.add_batch(batch, lines)
        if not problems:
            runner.start(batch["id"])
        return _json(runner.view(batch))

    @app.api_route("/v1/batches", methods=["GET", "HEAD"])
    async def list_batches(limit: int = 20, after: str | None = None) -> Response:
        if not 1 <= limit <= 100:
            raise GatewayError(400, f"limit must be 1 to 100, got {limit}", param="limit")
        batches = store.batches()[::-1]  # newest first, as OpenAI lists them
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = [runner.view(b) for b in batches[:limit]]
        return _json({
            "object": "list", "data": page, "has_more": len(batches) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })  # fmt: skip

    @app.api_route("/v1/batches/{batch_id}", methods=["GET", "HEAD"])
    async def retrieve_batch(batch_id: str) -> Response:
        return _json(runner.view(batch_or_404(batch_id)))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        batch = batch_or_404(batch_id)
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            raise GatewayError(409, f"batch {batch_id} is {batch['status']}: there is nothing to cancel")
        return _json(runner.cancel(batch_id))
