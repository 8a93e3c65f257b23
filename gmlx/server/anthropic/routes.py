"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A stream is Anthropic's typed event sequence: message_start, content_block_start,
content_block_delta (one per text piece), content_block_stop, message_delta (the
stop reason and output tokens), message_stop; a failure after the start is an
``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.errors import GmlxError
from gmlx.engine.structured import compile_output_config, compile_response_format
from gmlx.server import generation, sse
from gmlx.server.anthropic import translate
from gmlx.server.anthropic.schemas import CountTokensBody, MessagesBody
from gmlx.server.errors import error_body
from gmlx.server.generation import Job

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesBody, request: Request) -> Response:
    tools, forced = translate.tools_and_choice(body)
    job = await generation.start(
        request,
        body,
        messages=translate.chat_messages(body),
        tools=tools,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        grammar=compile_output_config(body.output_config) or compile_response_format(body.response_format),
        forced_tool=forced,
    )
    headers = {"x-request-id": job.handle.id}
    if body.stream:
        return sse.stream_response(_stream(job), headers)
    result = await generation.collect(job, request)
    return JSONResponse(
        translate.message(
            job,
            result,
            stop=translate.stop_reason(result.finish_reason, result.stop_sequence),
            stop_sequence=result.stop_sequence,
            usage=result.usage,
        ),
        headers=headers,
    )


async def _stream(job: Job) -> AsyncIterator[str]:
    """Blocks open as their content arrives: a thinking block, a text block, one
    tool_use block per call; each closes before the next opens."""

    def emit(kind: str, **fields: Any) -> str:
        return sse.event({"type": kind, **fields}, kind)

    index, open_kind = -1, None
    delta_templates: dict[tuple[str, int], sse.Template] = {}

    def delta(kind: str, field: str, value: str) -> str:
        """A text or thinking delta of the open block (its frame serialized once)."""
        if (frame := delta_templates.get((kind, index))) is None:
            frame = delta_templates[kind, index] = sse.Template(
                {"type": "content_block_delta", "index": index, "delta": {"type": kind, field: sse.FILL}},
                "content_block_delta",
            )
        return frame(value)

    def switch(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = [emit("content_block_stop", index=index)] if open_kind else []
        index, open_kind = index + 1, kind
        out.append(emit("content_block_start", index=index, content_block=block))
        return out

    yield emit("message_start", message=translate.message(job, None))
    try:
        async for ev in generation.events(job):
            if ev is None:
                yield sse.KEEPALIVE
                continue
            if ev.reasoning:
                if open_kind != "thinking":
                    for line in switch("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield line
                yield delta("thinking_delta", "thinking", ev.reasoning)
            if ev.text:
                if open_kind != "text":
                    for line in switch("text", {"type": "text", "text": ""}):
                        yield line
                yield delta("text_delta", "text", ev.text)
            for call in ev.tool_calls:
                block = translate.tool_use(call)
                for line in switch("tool_use", {**block, "input": {}}):
                    yield line
                yield emit("content_block_delta", index=index,
                           delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            if not ev.final:
                continue
            assert ev.finish_reason is not None and ev.usage is not None
            if open_kind is None:  # an empty answer still has its (empty) text block
                for line in switch("text", {"type": "text", "text": ""}):
                    yield line
            yield emit("content_block_stop", index=index)
            delta = {
                "stop_reason": translate.stop_reason(ev.finish_reason, ev.stop_sequence),
                "stop_sequence": ev.stop_sequence,
            }
            yield emit(
                "message_delta", delta=delta, usage={"output_tokens": ev.usage.completion_tokens}
            )
            if ev.error is not None:  # shed: the stream says why
                yield sse.event(error_body(ev.error, "anthropic"), "error")
                return
            yield emit("message_stop")
    except GmlxError as e:
        yield sse.event(error_body(e, "anthropic"), "error")


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensBody, request: Request) -> Response:
    rendered = await generation.render(
        request, body, messages=translate.chat_messages(body), tools=translate.tools_and_choice(body)[0]
    )
    return JSONResponse({"input_tokens": len(rendered.ids)})
