"""The request-body size limit, enforced before a route reads, parses or tokenizes anything.

A declared `Content-Length` over the limit is answered at once, without reading the body. Otherwise (chunked
bodies, or a client sending more than it declared) the bytes are counted as the route reads them, and reading
stops with a 413 at the first chunk past the limit: at most the limit plus one chunk is ever held.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import GatewayError


class BodyTooLarge(GatewayError):
    def __init__(self, limit: int, length: int | None = None) -> None:
        size = f"{length} bytes" if length is not None else f"more than {limit} bytes"
        super().__init__(413, f"the request body is {size}; at most {limit} bytes are accepted")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server has already refused a malformed one
    return None


class BodySizeLimit:
    """ASGI middleware: a body over `limit` bytes (`paths[path]` for the paths named there) is a 413 in the OpenAI
    error shape; `on_reject(413)` is told."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        on_reject: Callable[[int], None] | None = None,
        paths: dict[str, int] | None = None,
    ) -> None:
        if limit < 1 or any(v < 1 for v in (paths or {}).values()):
            raise ValueError(f"body limits must be positive, got {limit} and {paths}")
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.paths = dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.limit)
        length = _content_length(scope)
        if length is not None and length > limit:
            if self.on_reject is not None:
                self.on_reject(413)
            await BodyTooLarge(limit, length).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)  # the app's GatewayError handler answers it
            return message

        await self.app(scope, limited, send)
