"""Server-sent events: framing, the OpenAI terminator, and keep-alive comments."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"

_END = object()


def event(data: Any, name: str | None = None) -> str:
    """One SSE event; ``name`` adds an ``event:`` line (Anthropic and Responses use it)."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"


async def with_keepalive(source: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """Pass ``source`` through, adding a comment line whenever it is silent for ``interval``
    seconds (a long prefill), so clients' read timeouts do not drop the connection.

    ``source`` runs in its own task; closing this iterator (a client disconnect)
    cancels that task, and with it the engine request ``source`` consumes.
    """
    if interval <= 0:
        async for chunk in source:
            yield chunk
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in source:
                queue.put_nowait(chunk)
        except Exception as e:  # noqa: BLE001 - re-raised on the consumer's side
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                yield KEEPALIVE
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()


def stream_response(
    source: AsyncIterator[str], interval: float, headers: dict[str, str] | None = None
) -> StreamingResponse:
    """An SSE response over ``source`` with keep-alive comments."""
    return StreamingResponse(
        with_keepalive(source, interval),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )
