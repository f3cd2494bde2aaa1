"""The stack token on /health: how `spindle up` tells its own gateway from another server on the same port."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spindle_protocol.service import STACK_TOKEN_HEADER


def with_stack_token(app: ASGIApp, token: str | None) -> ASGIApp:
    """`app`, whose /health responses carry the header `x-spindle-stack: <token>`; `app` itself without a token."""
    if not token:
        return app
    header = (STACK_TOKEN_HEADER.encode("latin-1"), token.encode("latin-1"))

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != "/health":
            await app(scope, receive, send)
            return

        async def send_with_token(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await app(scope, receive, send_with_token)

    return wrapped
