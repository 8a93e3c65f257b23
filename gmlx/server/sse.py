"""Server-sent events: framing, the OpenAI terminator, and keep-alive comments."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Send

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
FILL = "\ue000gmlx-fill\ue000"  # where a Template takes its per-token string

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_encode_str = json.encoder.encode_basestring  # what the encoder does to a str, in C


def event(data: Any, name: str | None = None) -> str:
    """One SSE event; ``name`` adds an ``event:`` line (Anthropic and Responses use it)."""
    return (f"event: {name}\n" if name else "") + f"data: {_encoder.encode(data)}\n\n"


class Template:
    """An event that repeats with one string changed (a text delta): serialized once
    with :data:`FILL` in that place, then filled per token with the same bytes
    :func:`event` would give, at a fraction of its cost."""

    def __init__(self, data: Any, name: str | None = None) -> None:
        self._head, self._tail = event(data, name).split(_encode_str(FILL))

    def __call__(self, value: str) -> str:
        return self._head + _encode_str(value) + self._tail


CUT_SEND_S = 5.0  # how long a cut stream waits for its client to take the closing frames


class Cut:
    """Cuts a stream whose sender may be blocked on a client that does not read:
    calling it with the closing frames (a protocol's error event) stops the sending
    wherever it waits, and the response sends those frames instead of the rest."""

    def __init__(self) -> None:
        self.frames: str | None = None
        self.scope: anyio.CancelScope | None = None

    def __call__(self, frames: str) -> None:
        if self.frames is None:
            self.frames = frames
            if self.scope is not None:
                self.scope.cancel()


class SSEResponse(StreamingResponse):
    """A streaming response that a :class:`Cut` can end early. Ending costs nothing
    per frame: one cancel scope covers the whole stream."""

    def __init__(self, source: AsyncIterator[str], headers: dict[str, str], cut: Cut) -> None:
        super().__init__(source, media_type="text/event-stream", headers=headers)
        self.cut = cut

    async def stream_response(self, send: Send) -> None:
        with anyio.CancelScope() as scope:
            self.cut.scope = scope
            await super().stream_response(send)
        if self.cut.frames is None:
            return
        # The client may take the closing frames yet; if it does not, the response
        # stays incomplete and the server closes the connection.
        with anyio.move_on_after(CUT_SEND_S):
            await send({"type": "http.response.body", "body": self.cut.frames.encode(), "more_body": False})


def stream_response(source: AsyncIterator[str], headers: dict[str, str] | None = None,
                    cut: Cut | None = None) -> StreamingResponse:
    """An SSE response over ``source`` (which sends its own keep-alive comments);
    ``cut`` can end it early."""
    return SSEResponse(
        source,
        {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        cut or Cut(),
    )
