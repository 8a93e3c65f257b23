"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A stream is Anthropic's typed event sequence: message_start, content_block_start,
content_block_delta (one per text piece), content_block_stop, message_delta (the
stop reason and the final usage), message_stop; a failure after the start is an
``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.chat import Engine, Job
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import Event
from gmlx.server import sse, streaming
from gmlx.server.anthropic import translate
from gmlx.server.anthropic.schemas import (
    CountTokensBody,
    CountTokensRequest,
    MessagesBody,
    MessagesRequest,
)
from gmlx.server.errors import error_body
from gmlx.server.schemas import documented

router = APIRouter()


@router.post("/v1/messages", openapi_extra=documented(MessagesRequest))
async def messages(body: MessagesBody, request: Request) -> Response:
    engine: Engine = request.app.state.engine
    req = translate.messages_request(body)
    streaming.warn_ignored(request, body)
    if body.stream:
        return await streaming.start_stream(engine, req, MessageStream, failed, request)
    job = await engine.start(req)
    result = await streaming.answer(job, request)
    return JSONResponse(
        translate.message(
            job,
            result,
            stop=translate.stop_reason(result.finish_reason, result.stop_sequence),
            stop_sequence=result.stop_sequence,
            usage=result.usage,
        ),
        headers=streaming.headers(job),
    )


def failed(error: GmlxError) -> str:
    """A stream that failed before ``message_start``: the ``error`` event."""
    return sse.event(error_body(error, "anthropic"), "error")


class MessageStream:
    """Blocks open as their content arrives: a thinking block, a text block, one
    tool_use block per call; each closes before the next opens."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.index = -1
        self.open_kind: str | None = None  # the open block's kind
        self.templates: dict[tuple[str, int], sse.Template] = {}

    @staticmethod
    def emit(kind: str, **fields: Any) -> str:
        return sse.event({"type": kind, **fields}, kind)

    def delta(self, kind: str, field: str, value: str) -> str:
        """A text or thinking delta of the open block (its frame serialized once)."""
        if (frame := self.templates.get((kind, self.index))) is None:
            frame = self.templates[kind, self.index] = sse.Template(
                {"type": "content_block_delta", "index": self.index,
                 "delta": {"type": kind, field: sse.FILL}},
                "content_block_delta",
            )
        return frame(value)

    def switch(self, kind: str, block: dict[str, Any]) -> str:
        out = self.emit("content_block_stop", index=self.index) if self.open_kind else ""
        self.index, self.open_kind = self.index + 1, kind
        return out + self.emit("content_block_start", index=self.index, content_block=block)

    def opening(self) -> str:
        return self.emit("message_start", message=translate.message(self.job, None))

    def event(self, ev: Event) -> str:
        out = ""
        if ev.reasoning:
            if self.open_kind != "thinking":
                out += self.switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self.delta("thinking_delta", "thinking", ev.reasoning)
        if ev.text:
            if self.open_kind != "text":
                out += self.switch("text", {"type": "text", "text": ""})
            out += self.delta("text_delta", "text", ev.text)
        for call in ev.tool_calls:
            block = translate.tool_use(call)
            out += self.switch("tool_use", {**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            out += self.emit("content_block_delta", index=self.index,
                             delta={"type": "input_json_delta", "partial_json": partial})
        if not ev.final:
            return out
        assert ev.finish_reason is not None and ev.usage is not None
        if self.open_kind is None:  # an empty answer still has its (empty) text block
            out += self.switch("text", {"type": "text", "text": ""})
        out += self.emit("content_block_stop", index=self.index)
        delta = {
            "stop_reason": translate.stop_reason(ev.finish_reason, ev.stop_sequence),
            "stop_sequence": ev.stop_sequence,
        }
        # The final usage, whole: message_start went out before the cache lookup.
        usage = translate.message_usage(self.job, ev.usage)
        out += self.emit("message_delta", delta=delta, usage=usage)
        if ev.error is not None:  # shed: the stream says why, and ends there
            return out + self.error(ev.error)
        return out + self.emit("message_stop")

    def error(self, error: GmlxError) -> str:
        return sse.event(error_body(error, "anthropic"), "error")

    def closing(self) -> str:
        return ""


@router.post("/v1/messages/count_tokens", openapi_extra=documented(CountTokensRequest))
async def count_tokens(body: CountTokensBody, request: Request) -> Response:
    engine: Engine = request.app.state.engine
    return JSONResponse({"input_tokens": await engine.count_tokens(translate.messages_request(body))})
