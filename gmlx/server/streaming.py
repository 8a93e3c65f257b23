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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from gmlx.engine.chat import Engine, Job, Result, collect
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import ChatRequest, Event
from gmlx.server import sse
from gmlx.server.schemas import GenerationBody

log = logging.getLogger("gmlx.server")


def warn_ignored(request: Request, body: GenerationBody, *, dropped_tools: Sequence[str] = ()) -> None:
    """One warning line naming every field this route accepted but does not honour,
    and the tools it dropped (hosted tools, which no local model can run)."""
    names = body.ignored()
    if dropped_tools:
        names.append(f"tools ({', '.join(dropped_tools)})")
    if names:
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


async def _frames(job: Job, renderer: Renderer, keepalive_s: float,
                  cut: sse.Cut | None = None) -> AsyncIterator[str]:
    finished = False
    cut = cut or sse.Cut()
    # A client too slow for its stream: the response ends with the protocol's error
    # event, wherever the sending waits.
    job.handle.on_cut = lambda error: cut(renderer.error(error) + renderer.closing())
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


async def _frames_after_start(
    start: Awaitable[Job],
    renderer_for: Callable[[Job], Renderer],
    failed: Callable[[GmlxError], str],
    keepalive_s: float,
    cut: sse.Cut,
) -> AsyncIterator[str]:
    task = asyncio.ensure_future(start)
    try:
        while not task.done():  # the model loads: keep the connection alive meanwhile
            await asyncio.wait({task}, timeout=keepalive_s or None)
            if not task.done():
                yield sse.KEEPALIVE
        job = task.result()
    except GmlxError as e:
        yield failed(e)
        return
    finally:
        if not task.done():  # the client left during the load: cancel what it started
            task.add_done_callback(_cancel_started)
    async for frames in _frames(job, renderer_for(job), keepalive_s, cut):
        yield frames


def _cancel_started(task: asyncio.Future[Job]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().handle.cancel()


def stream_after_start(
    start: Awaitable[Job],
    renderer_for: Callable[[Job], Renderer],
    failed: Callable[[GmlxError], str],
    request: Request,
) -> StreamingResponse:
    """The SSE response of a request whose model is still to load: the stream opens at
    once and sends keep-alive comments until ``start`` has submitted the request, then
    goes on as :func:`stream` with ``renderer_for(job)``. A failure to start (the load
    failed, the prompt does not fit) is sent as ``failed(error)``: the status line has
    gone out already."""
    keepalive_s = request.app.state.settings.server.sse_keepalive_s
    cut = sse.Cut()
    return sse.stream_response(_frames_after_start(start, renderer_for, failed, keepalive_s, cut), cut=cut)


def stream(job: Job, renderer: Renderer, request: Request) -> StreamingResponse:
    """The SSE response of a request: ``renderer``'s frames, with a keep-alive comment
    after every ``sse_keepalive_s`` of silence (a queued request, a long prefill)."""
    keepalive_s = request.app.state.settings.server.sse_keepalive_s
    cut = sse.Cut()
    return sse.stream_response(_frames(job, renderer, keepalive_s, cut), headers(job), cut)


async def start_stream(
    engine: Engine,
    req: ChatRequest,
    renderer_for: Callable[[Job], Renderer],
    failed: Callable[[GmlxError], str],
    request: Request,
) -> StreamingResponse:
    """Start a streamed request: at once when its model is resident (errors before the
    stream are plain HTTP errors), else as :func:`stream_after_start`, so the client
    gets keep-alives while the model loads."""
    if engine.resident(req):
        job = await engine.start(req)
        return stream(job, renderer_for(job), request)
    return stream_after_start(engine.start(req), renderer_for, failed, request)
