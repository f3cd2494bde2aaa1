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
    """ASGI middleware: a body over `limit` bytes is a 413 in the OpenAI error shape; `on_reject(413)` is told."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[int], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the body limit must be positive, got {limit}")
        self.app = app
        self.limit = limit
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.limit:
            if self.on_reject is not None:
                self.on_reject(413)
            await BodyTooLarge(self.limit, length).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)  # the app's GatewayError handler answers it
            return message

        await self.app(scope, limited, send)
