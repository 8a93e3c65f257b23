"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A stream is Anthropic's typed event sequence: message_start, content_block_start,
content_block_delta (one per text piece), content_block_stop, message_delta (the
stop reason and output tokens), message_stop; a failure after the start is an
``error`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.errors import GmlxError
from gmlx.server import generation, sse
from gmlx.server.anthropic import translate
from gmlx.server.anthropic.schemas import CountTokensBody, MessagesBody
from gmlx.server.errors import error_body
from gmlx.server.generation import Job

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesBody, request: Request) -> Response:
    job = await generation.start(
        request,
        body,
        messages=translate.chat_messages(body),
        tools=translate.template_tools(body),
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
    )
    headers = {"x-request-id": job.handle.id}
    if body.stream:
        return sse.stream_response(
            _stream(job), request.app.state.settings.server.sse_keepalive_s, headers
        )
    result = await generation.collect(job, request)
    return JSONResponse(
        translate.message(
            job,
            result.text,
            stop=translate.stop_reason(result.finish_reason, result.stop_sequence),
            stop_sequence=result.stop_sequence,
            usage=result.usage,
        ),
        headers=headers,
    )


async def _stream(job: Job) -> AsyncIterator[str]:
    def emit(kind: str, **fields: Any) -> str:
        return sse.event({"type": kind, **fields}, kind)

    yield emit("message_start", message=translate.message(job, None))
    yield emit("content_block_start", index=0, content_block={"type": "text", "text": ""})
    try:
        async for ev in generation.events(job):
            if ev.text:
                yield emit(
                    "content_block_delta", index=0, delta={"type": "text_delta", "text": ev.text}
                )
            if not ev.final:
                continue
            assert ev.finish_reason is not None and ev.usage is not None
            yield emit("content_block_stop", index=0)
            delta = {
                "stop_reason": translate.stop_reason(ev.finish_reason, ev.stop_sequence),
                "stop_sequence": ev.stop_sequence,
            }
            yield emit(
                "message_delta", delta=delta, usage={"output_tokens": ev.usage.completion_tokens}
            )
            yield emit("message_stop")
    except GmlxError as e:
        yield sse.event(error_body(e, "anthropic"), "error")


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensBody, request: Request) -> Response:
    rendered = await generation.render(
        request, body, messages=translate.chat_messages(body), tools=translate.template_tools(body)
    )
    return JSONResponse({"input_tokens": len(rendered.ids)})
