"""What every generation route does around the engine: the one warning about ignored
fields, a whole answer that a disconnect cancels, and one streaming skeleton.

:func:`stream` owns what all four streaming routes share (keep-alive comments during
silences, an error after the stream began, the end of the stream, cancelling the
request when the client leaves); a protocol supplies only a :class:`Renderer`, which
turns the engine's events into that protocol's SSE frames.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from gmlx.engine.chat import Job, Result, collect
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import Event
from gmlx.server import sse
from gmlx.server.schemas import GenerationBody

log = logging.getLogger("gmlx.server")


def warn_ignored(request: Request, body: GenerationBody) -> None:
    """One warning line naming every field this route accepted but does not honour."""
    if names := body.ignored():
        log.warning("%s: ignored parameters: %s", request.url.path, ", ".join(names))


def headers(job: Job) -> dict[str, str]:
    return {"x-request-id": job.handle.id}


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    # The body is already read, so the next ASGI message is the client leaving.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.handle.cancel()
            return


async def answer(job: Job, request: Request) -> Result:
    """The whole answer; a client that disconnects meanwhile cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        return await collect(job)
    finally:
        watcher.cancel()


class Renderer(Protocol):
    """A protocol's SSE rendering of one request's events. Each method returns the
    frames to send (possibly none, as an empty string)."""

    def opening(self) -> str:
        """Frames before any event (a role chunk, a ``message_start``)."""

    def event(self, ev: Event) -> str:
        """Frames for one engine event, the final one included."""

    def error(self, error: GmlxError) -> str:
        """Frames for a failure after the stream began."""

    def closing(self) -> str:
        """Frames after the final event or an error (``[DONE]``), if the protocol has any."""


async def _frames(job: Job, renderer: Renderer, keepalive_s: float) -> AsyncIterator[str]:
    finished = False
    try:
        if opening := renderer.opening():
            yield opening
        try:
            async for ev in job.handle.stream(keepalive_s):
                if ev is None:
                    yield sse.KEEPALIVE
                    continue
                finished = ev.final
                if frames := renderer.event(ev):
                    yield frames
        except GmlxError as e:
            yield renderer.error(e)
        if closing := renderer.closing():
            yield closing
    finally:
        if not finished:  # the client left (the iterator was closed early)
            job.handle.cancel()


def stream(job: Job, renderer: Renderer, request: Request) -> StreamingResponse:
    """The SSE response of a request: ``renderer``'s frames, with a keep-alive comment
    after every ``sse_keepalive_s`` of silence (a queued request, a long prefill)."""
    keepalive_s = request.app.state.settings.server.sse_keepalive_s
    return sse.stream_response(_frames(job, renderer, keepalive_s), headers(job))
