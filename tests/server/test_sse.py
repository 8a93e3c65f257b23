"""SSE keep-alive ticks, event templates, and errors that happen after a stream has started."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

from gmlx.engine.chat import Job
from gmlx.engine.errors import EngineError
from gmlx.engine.requests import RequestHandle
from gmlx.engine.types import Event, FinishReason, GenerateRequest, Usage
from gmlx.server import sse
from gmlx.server.anthropic.routes import MessageStream
from gmlx.server.openai.routes import ChatStream
from gmlx.server.streaming import _frames


async def _collect(source: AsyncIterator[str]) -> list[str]:
    return [chunk async for chunk in source]


def test_a_silent_request_ticks_and_a_busy_one_does_not():
    """The handle yields None for each silence of ``idle_s`` (the stream's keep-alive),
    events in order, and nothing extra when ticks are off or events come sooner. The
    worker's side speaks only once the reader has seen the ticks it waits for, so no
    clock decides what is seen."""

    async def run(idle_s: float, ticks_first: int) -> list[Event | None]:
        handle = RequestHandle(GenerateRequest((1, 2)), cancel=lambda request_id: None)
        loop = asyncio.get_running_loop()
        heard = threading.Event()

        def produce() -> None:  # the worker's side, from another thread
            assert heard.wait(30), "the reader never saw its ticks"
            handle._emit(Event(handle.id, text="a", token_ids=(5,)))
            handle._emit(Event(handle.id, finish_reason=FinishReason.STOP, usage=Usage(2, 1)))

        if ticks_first == 0:
            heard.set()
        producer = loop.run_in_executor(None, produce)
        out: list[Event | None] = []
        async for ev in handle.stream(idle_s):
            out.append(ev)
            if out.count(None) == ticks_first:
                heard.set()
        await producer
        return out

    ticked = asyncio.run(run(0.01, ticks_first=3))
    assert [ev.text for ev in ticked if ev is not None] == ["a", ""]
    assert ticked[-1] is not None and ticked[-1].final
    assert ticked[:3] == [None, None, None]  # silence ticks, before any event
    for idle_s in (0, 3600):  # ticks off; ticks on, but the events come first
        plain = asyncio.run(run(idle_s, ticks_first=0))
        assert None not in plain and len(plain) == 2


class FailingHandle:
    """Yields one text event, then fails the way a worker error surfaces."""

    id = "req-test"

    def __init__(self) -> None:
        self.cancelled = False

    async def stream(self, idle_s: float = 0.0) -> AsyncIterator[Event | None]:
        yield Event(self.id, text="partial", token_ids=(1,))
        raise EngineError("Generation failed: boom.")

    def cancel(self) -> None:
        self.cancelled = True


def test_openai_stream_error_is_an_event_then_done():
    handle = FailingHandle()
    job = Job(handle, "demo", 3, 0)  # type: ignore[arg-type]
    chunks = asyncio.run(_collect(_frames(job, ChatStream(job, False, False, False), 0)))
    assert chunks[-1] == sse.DONE
    error = json.loads(chunks[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error" and "boom" in error["error"]["message"]
    assert handle.cancelled


def test_anthropic_stream_error_is_an_error_event():
    job = Job(FailingHandle(), "demo", 3, 0)  # type: ignore[arg-type]
    chunks = asyncio.run(_collect(_frames(job, MessageStream(job), 0)))
    assert chunks[0].startswith("event: message_start")
    assert chunks[-1].startswith("event: error\n")
    body = json.loads(chunks[-1].split("data: ", 1)[1])
    assert body == {
        "type": "error",
        "error": {"type": "api_error", "message": "Generation failed: boom."},
    }


def test_templates_give_the_bytes_a_full_serialization_gives():
    frame = {"id": "x", "choices": [{"delta": {"content": sse.FILL}, "finish_reason": None}]}
    template = sse.Template(frame, "delta")
    for text in ["hi", 'quote " and \\ slash', "line\nbreak\ttab\x00", "é 中文 😀 \u2028", ""]:
        expected = sse.event({"id": "x", "choices": [{"delta": {"content": text}, "finish_reason": None}]}, "delta")
        assert template(text) == expected
