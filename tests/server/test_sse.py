"""SSE keep-alive comments and errors that happen after a stream has started."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from gmlx.engine.errors import EngineError
from gmlx.engine.types import Event
from gmlx.server import sse
from gmlx.server.anthropic.routes import _stream as anthropic_stream
from gmlx.server.generation import Job
from gmlx.server.openai.routes import ChatStreamOptions, _chat_stream


async def _collect(source: AsyncIterator[str]) -> list[str]:
    return [chunk async for chunk in source]


def test_keepalive_fills_silences():
    async def slow() -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(0.25)
        yield "b"

    out = asyncio.run(_collect(sse.with_keepalive(slow(), 0.05)))
    assert out[0] == "a" and out[-1] == "b"
    assert sse.KEEPALIVE in out[1:-1]
    assert asyncio.run(_collect(sse.with_keepalive(slow(), 0))) == ["a", "b"]


class FailingHandle:
    """Yields one text event, then fails the way a worker error surfaces."""

    id = "req-test"

    def __init__(self) -> None:
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[Event]:
        yield Event(self.id, text="partial", token_ids=(1,))
        raise EngineError("Generation failed: boom.")

    def cancel(self) -> None:
        self.cancelled = True


def test_openai_stream_error_is_an_event_then_done():
    handle = FailingHandle()
    chunks = asyncio.run(_collect(_chat_stream(Job(handle, "demo", 3, 0), ChatStreamOptions(False, False, False))))  # type: ignore[arg-type]
    assert chunks[-1] == sse.DONE
    error = json.loads(chunks[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error" and "boom" in error["error"]["message"]
    assert handle.cancelled


def test_anthropic_stream_error_is_an_error_event():
    chunks = asyncio.run(_collect(anthropic_stream(Job(FailingHandle(), "demo", 3, 0))))  # type: ignore[arg-type]
    assert chunks[0].startswith("event: message_start")
    assert chunks[-1].startswith("event: error\n")
    body = json.loads(chunks[-1].split("data: ", 1)[1])
    assert body == {
        "type": "error",
        "error": {"type": "api_error", "message": "Generation failed: boom."},
    }
