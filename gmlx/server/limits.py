"""Request limits enforced before a route runs: the body size, as an ASGI middleware.

A body larger than ``server.max_body_bytes`` is refused with a 413 in the route's
protocol shape before it is read whole: a ``Content-Length`` over the limit is refused
before any of the body is read (what the client still sends is then dropped for a
moment, so that it reads the refusal rather than a reset connection), and a body sent
without one (chunked) is read only until it passes the limit. A body within the limit
is read once and replayed to the app, so the routes parse it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gmlx.engine.errors import PayloadTooLargeError
from gmlx.server.errors import error_body, protocol_for

# Seconds a refused body's rest is read and dropped before its connection is closed.
LINGER_S = 2.0


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413), reading at most one chunk past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, send, declared, receive)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, declared: int | None,
                      linger: Receive | None = None) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        err = PayloadTooLargeError(
            f"Request body too large: the limit is {self.max_bytes} bytes "
            f"(server.max_body_bytes), and this one is {size}."
        )
        payload = json.dumps(error_body(err, protocol_for(scope.get("path", "")))).encode()
        # The unread rest of the body makes the connection unusable: close it.
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        if linger is None:
            await send({"type": "http.response.body", "body": payload})
            return
        # The whole answer goes out now, but the connection stays open while the body the
        # client is still sending is read and dropped (for at most LINGER_S): a socket closed
        # with unread data is reset, and a client that writes its body before reading the
        # answer (most HTTP clients) would lose the 413 to the reset.
        await send({"type": "http.response.body", "body": payload, "more_body": True})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while (await linger()).get("more_body", False):
                    pass
        await send({"type": "http.response.body", "body": b""})


def _content_length(scope: Scope) -> int | None:
    headers: Any = scope.get("headers") or []
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
