"""OpenAI-style error JSON, `{"error": {"message", "type", "param", "code"}}`, and the app's error handlers.

Types follow vLLM's names (`BadRequestError`, `NotFoundError`, ...); `code` is the HTTP status. Every error the
gateway answers with goes through `GatewayError`, so FastAPI's 422 and Starlette's HTML-ish defaults never leak.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("spindle.gateway")

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "timeout",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")


class GatewayError(Exception):
    """A request that ends in an HTTP error; `retry_after` (seconds) becomes a Retry-After header, `headers` are
    sent as they are (e.g. a 405's Allow)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Messages may quote client input; a lone surrogate in it must not break the JSON encoder.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.type = type_ or error_type(self.status)
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return Response(
            msgspec.json.encode(self.body()), status_code=self.status, headers=headers, media_type="application/json"
        )


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the offending field) from pydantic's error list."""
    parts = []
    param = None
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        param = param or (loc or None)
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request", param


def allowed_methods(request: Request) -> list[str]:
    """The methods some route of the app serves at this request's path (what a 405's Allow header lists)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= set(route_methods)
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return sorted(methods, key=lambda m: (order.index(m) if m in order else len(order), m))


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Route every failure to the OpenAI error shape. `on_error(status)` is told about each (for metrics)."""

    def respond(err: GatewayError) -> Response:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(list(exc.errors()))
        return respond(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            allow = allowed_methods(request)
            headers["Allow"] = ", ".join(allow)
            message = f"method {request.method} is not allowed for {request.url.path}; allowed: {headers['Allow']}"
        elif exc.status_code == 404 and message == "Not Found":  # the router's: no route has this path
            message = f"no route {request.method} {request.url.path}"
        return respond(GatewayError(exc.status_code, message, headers=headers))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return respond(GatewayError(500, f"internal error: {type(exc).__name__}"))
